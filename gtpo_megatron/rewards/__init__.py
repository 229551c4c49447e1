"""Rewards for math reasoning: answer formats, math-verify equivalence, the reward registry and a timeout-safe pool.

Public API (rules in ``docs/rewards.md``): ``get_reward(name)`` -> ``reward_fn(*, completion, reference,
extraction) -> RewardResult(score, correct, format_ok, extracted)`` (``math_verify``, ``format``, ``paper``),
``register_reward``, ``decimal_tolerance``, ``reward_span``; ``EXTRACTION_MODES``, ``default_extraction``,
``check_extraction``; ``RewardPool(...).score`` / ``.same_answers`` and ``check_grader_failures``; ``grade``,
``same_answer``, ``reference_answer``, ``grading_deadline`` / ``GradingTimeout``. The math-verify names (about
2 s to import) load on first use, so the light text helpers do not import them on every training rank.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gtpo_megatron.rewards.answer_text import EXTRACTION_MODES, check_extraction, default_extraction, reference_answer
from gtpo_megatron.rewards.deadline import GradingTimeout, grading_deadline

if TYPE_CHECKING:
    from gtpo_megatron.rewards.math_answer import Verdict, grade, same_answer
    from gtpo_megatron.rewards.pool import RewardPool, check_grader_failures
    from gtpo_megatron.rewards.registry import (
        REWARD_REGISTRY,
        RewardFn,
        RewardResult,
        decimal_tolerance,
        get_reward,
        register_reward,
        reward_span,
    )

_LAZY = {
    "Verdict": "math_answer",
    "grade": "math_answer",
    "same_answer": "math_answer",
    "RewardPool": "pool",
    "check_grader_failures": "pool",
    "REWARD_REGISTRY": "registry",
    "RewardFn": "registry",
    "RewardResult": "registry",
    "decimal_tolerance": "registry",
    "get_reward": "registry",
    "register_reward": "registry",
    "reward_span": "registry",
}


def __getattr__(name: str) -> Any:
    """The math-verify based names of ``_LAZY``, imported from their module on first use (PEP 562)."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)


__all__ = [
    "EXTRACTION_MODES",
    "REWARD_REGISTRY",
    "GradingTimeout",
    "RewardFn",
    "RewardPool",
    "RewardResult",
    "Verdict",
    "check_extraction",
    "check_grader_failures",
    "decimal_tolerance",
    "default_extraction",
    "get_reward",
    "grade",
    "grading_deadline",
    "reference_answer",
    "reward_span",
    "register_reward",
    "same_answer",
]
