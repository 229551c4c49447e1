"""Rewards for math reasoning: answer formats, math-verify equivalence, the reward registry and a timeout-safe pool.

Public API (stable; details in each module's docstring):

- ``get_reward(name)`` -> ``reward_fn(*, completion: str, reference: str, extraction: str) -> RewardResult`` with
  fields ``score: float``, ``correct: bool``, ``format_ok: bool``, ``extracted: str | None``. Names:
  ``math_verify``, ``format``, ``paper`` (docs/algorithm.md section 6). ``register_reward(name)`` adds one;
  ``decimal_tolerance(name)`` is its numeric rule for plain decimal answers, ``reward_span(name)`` its score range
  (highest minus lowest score).
- Extraction modes: ``EXTRACTION_MODES`` (``strict``, ``lenient``), ``default_extraction(benchmark)``,
  ``check_extraction(mode)``.
- ``RewardPool(reward_name, num_workers=2, timeout_s=5.0)``: ``.score(completions, references, extraction=...)
  -> (results, stats)``, ``.same_answers(pairs) -> (verdicts, stats)`` (maj@k classes), ``.close()``, context
  manager. ``check_grader_failures(stats, max_error_frac=0.5)`` stops a run whose grader fails too often.
- ``grade``, ``same_answer``, ``reference_answer``: the pieces the rewards are built from;
  ``grading_deadline``/``GradingTimeout``: the per-answer time bound.

Depends only on the stdlib, math-verify and SymPy (no torch), so reward workers start fast. The names that need
math-verify and SymPy (about 2 s to import) load on first use, so that importing the light text helpers (the data
loaders read reference answers with ``reference_answer``) does not import them on every training rank.
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
