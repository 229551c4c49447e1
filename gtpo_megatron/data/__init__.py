"""Problem sets (``load_problems``), prompts, the resumable ``PromptLoader`` and DAPO's sampling helpers.

Public API (stable; details in each module's docstring):

- ``load_problems(source, *, path=None, split=None, limit=None, data_dir=None, seed=0, difficulty="easy")
  -> list[Problem]`` with ``Problem(id, question, answer, source)``; sources gsm8k, math500, aime24, aime25, amc23,
  mmlu, mmlu/<subject>, openr1-math, synthetic, math (HF) or a Hugging Face dataset name.
- ``build_prompt_text(tokenizer, question, *, system_prompt=SYSTEM_PROMPT) -> str`` and ``build_prompt_ids(...)
  -> list[int]``; ``SYSTEM_PROMPTS`` maps ``data.system_prompt`` (``authors``, ``concise``) to its text.
- ``PromptLoader(problems, *, batch_size, seed=0, shuffle=True)``: ``next_batch(size=None)``, iteration,
  ``state_dict()`` / ``load_state_dict(state)``.
- ``filter_uniform_groups``, ``overlong_penalty``, ``overlong_filter_mask``, ``shape_rewards``,
  ``choose_groups`` (DAPO).

Importing this package imports torch (for the sampling helpers) but neither megatron nor vllm.
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
