"""Cluster planning without GPUs: model dimensions, layout arithmetic and per-GPU memory estimates (``plan_cli``).

Pure arithmetic: importing it imports neither torch, megatron nor vllm.
"""

from gtpo_megatron.plan.architectures import KNOWN_ARCHITECTURES, Architecture, resolve_architecture
from gtpo_megatron.plan.layout import Layout, check_layout, padded_vocab_size
from gtpo_megatron.plan.memory import StageMemory, TrainingShape, estimate_stage, weight_sync_seconds

__all__ = [
    "KNOWN_ARCHITECTURES",
    "Architecture",
    "Layout",
    "StageMemory",
    "TrainingShape",
    "check_layout",
    "estimate_stage",
    "padded_vocab_size",
    "resolve_architecture",
    "weight_sync_seconds",
]
