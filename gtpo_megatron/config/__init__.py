"""Typed, frozen run configuration: one root ``GTPOConfig`` made of sections (PyYAML and the planner's arithmetic).

One module per group of sections (``model``, ``rollout``, ``algorithm``, ``run``: each section checks its own fields;
``run.GTPOConfig.validate`` the cross-section arithmetic), ``checks`` (the error shape) and ``loader`` (YAML
recipes, presets, shorthands and dotted overrides; nothing else imports it). Reading the model's ``config.json``
and Megatron's field names is ``megatron_adapter.validation.validate_config``'s job. Importing this package imports
neither torch, megatron nor vllm.
"""

from __future__ import annotations

from gtpo_megatron.config.algorithm import AlgorithmConfig
from gtpo_megatron.config.loader import PRESETS, config_to_dict, load_config, preset_values, save_config
from gtpo_megatron.config.lora import LoRAConfig
from gtpo_megatron.config.model import ModelConfig, OptimConfig, ParallelConfig
from gtpo_megatron.config.rollout import DataConfig, RewardConfig, RolloutConfig
from gtpo_megatron.config.run import CheckpointConfig, GTPOConfig, LoggingConfig, TrainerConfig

__all__ = [
    "PRESETS",
    "AlgorithmConfig",
    "CheckpointConfig",
    "DataConfig",
    "GTPOConfig",
    "LoRAConfig",
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
    "save_config",
]
