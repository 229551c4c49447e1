"""Megatron adapter tests (single process, fakes where possible) and shared helpers for the Megatron tests."""
