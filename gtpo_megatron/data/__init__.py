"""Problem sets (``load_problems``), prompts, the resumable ``PromptLoader`` and DAPO's sampling helpers.

Importing this package imports torch (for the DAPO helpers) but neither megatron nor vllm.
"""

from __future__ import annotations

from gtpo_megatron.data.datasets import default_data_dir, load_problems, read_jsonl
from gtpo_megatron.data.dynamic_sampling import choose_groups, filter_uniform_groups
from gtpo_megatron.data.loader import PromptLoader
from gtpo_megatron.data.overlong import overlong_filter_mask, overlong_penalty, shape_rewards
from gtpo_megatron.data.prompts import (
    SYSTEM_PROMPT,
    SYSTEM_PROMPTS,
    build_messages,
    build_prompt_ids,
    build_prompt_text,
)
from gtpo_megatron.data.synthetic import SYNTHETIC_LEVELS, SyntheticLevel, generate_problems
from gtpo_megatron.data.types import Problem

__all__ = [
    "SYNTHETIC_LEVELS",
    "SYSTEM_PROMPT",
    "SYSTEM_PROMPTS",
    "Problem",
    "PromptLoader",
    "SyntheticLevel",
    "build_messages",
    "build_prompt_ids",
    "build_prompt_text",
    "choose_groups",
    "default_data_dir",
    "filter_uniform_groups",
    "generate_problems",
    "load_problems",
    "overlong_filter_mask",
    "overlong_penalty",
    "read_jsonl",
    "shape_rewards",
]
