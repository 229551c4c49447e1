"""Typed, frozen run configuration (STYLE.md section 7): one root ``GTPOConfig`` made of sections.

``sections``: the frozen section dataclasses, their own checks and ``GTPOConfig.validate``; ``loader``: YAML recipes,
presets, shorthands and dotted overrides. ``loader`` imports ``sections``, never the reverse. Importing this package
imports neither torch, megatron nor vllm.
"""

from __future__ import annotations

from gtpo_megatron.config.loader import PRESETS, config_to_dict, load_config, preset_values, save_config
from gtpo_megatron.config.sections import (
    AlgorithmConfig,
    CheckpointConfig,
    DataConfig,
    GTPOConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    RewardConfig,
    RolloutConfig,
    TrainerConfig,
    read_hf_config,
)

__all__ = [
    "PRESETS",
    "AlgorithmConfig",
    "CheckpointConfig",
    "DataConfig",
    "GTPOConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "RewardConfig",
    "RolloutConfig",
    "TrainerConfig",
    "config_to_dict",
    "load_config",
    "preset_values",
    "read_hf_config",
    "save_config",
]
