"""Mixture-of-experts layers in Megatron (docs/moe.md).

The HF router and expert fields, megatron-core's MoE layer without TE or CUDA, the router metrics and rollout routing
replay. Importing this package imports nothing.
"""
