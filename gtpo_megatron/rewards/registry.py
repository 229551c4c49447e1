"""Reward functions by name: ``REWARD_REGISTRY``, ``register_reward``, ``get_reward``.

A reward is ``reward_fn(*, completion, reference, extraction) -> RewardResult``: ``math_verify``, ``format`` and
``paper`` (contract and definitions in ``docs/rewards.md``). A grader failure propagates (an exception, or
``GradingTimeout`` under a deadline) for the reward pool to count.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from gtpo_megatron.rewards.answer_text import STRICT


@dataclass(frozen=True, slots=True)
class RewardResult:
    """Score and diagnostics of one completion (field meanings in ``docs/rewards.md``)."""

    score: float
    correct: bool
    format_ok: bool
    extracted: str | None


class RewardFn(Protocol):
    """A reward function: keyword-only arguments, returns a :class:`RewardResult`."""

    def __call__(self, *, completion: str, reference: str, extraction: str) -> RewardResult:
        """Scores ``completion`` against ``reference`` in ``extraction`` mode (``strict`` or ``lenient``)."""
        ...


REWARD_REGISTRY: dict[str, RewardFn] = {}
_DECIMAL_TOLERANCES: dict[str, float] = {}
_SCORE_RANGES: dict[str, tuple[float, float]] = {}

_REASONING_RE = re.compile(r"<reasoning>.*?</reasoning>", re.DOTALL)
_ANSWER_AT_END_RE = re.compile(r"<answer>.*?</answer>\s*$", re.DOTALL)
PAPER_FORMAT_SCORE = 10.0
PAPER_CORRECT_SCORE = 10.0
PAPER_DECIMAL_TOLERANCE = 1e-2


def register_reward(
    name: str, *, score_range: tuple[float, float] = (0.0, 1.0), decimal_abs_tol: float | None = None
) -> Callable[[RewardFn], RewardFn]:
    """Decorator that adds a reward under ``name`` (scores in ``score_range``; ``decimal_abs_tol``: plain decimals).

    Raises:
        ValueError: ``name`` is already registered, or ``score_range`` is not increasing.
    """
    if not score_range[0] < score_range[1]:
        raise ValueError(f"score_range={score_range} of reward {name!r} must be (lowest, highest), lowest < highest")

    def decorator(fn: RewardFn) -> RewardFn:
        if name in REWARD_REGISTRY:
            raise ValueError(f"reward {name!r} is already registered; pick another name")
        REWARD_REGISTRY[name] = fn
        _SCORE_RANGES[name] = (float(score_range[0]), float(score_range[1]))
        if decimal_abs_tol is not None:
            _DECIMAL_TOLERANCES[name] = decimal_abs_tol
        return fn

    return decorator


def get_reward(name: str) -> RewardFn:
    """The reward function registered as ``name``; ``ValueError`` listing the names when unknown."""
    if name not in REWARD_REGISTRY:
        raise ValueError(f"unknown reward {name!r}; available rewards: {sorted(REWARD_REGISTRY)}")
    return REWARD_REGISTRY[name]


def reward_span(name: str) -> float:
    """Highest minus lowest score of reward ``name`` (the unit of ``algorithm.overlong_penalty``).

    Raises:
        ValueError: ``name`` is unknown.
    """
    get_reward(name)
    low, high = _SCORE_RANGES[name]
    return high - low


def decimal_tolerance(reward: str | RewardFn) -> float | None:
    """Absolute tolerance of a reward (name, or function: ``None``) for two plain decimals; ``None``: exact rules."""
    return _DECIMAL_TOLERANCES.get(reward) if isinstance(reward, str) else None


def paper_format_score(completion: str) -> float:
    """The paper's format part: 10, 1.5, 1 or 0 (``docs/rewards.md``)."""
    has_reasoning = _REASONING_RE.search(completion) is not None
    has_answer = _ANSWER_AT_END_RE.search(completion) is not None
    if has_reasoning and has_answer:
        return PAPER_FORMAT_SCORE
    if has_reasoning:
        return 1.5 if ("<answer>" in completion or "</answer>" in completion) else 1.0
    if has_answer:
        return 1.5 if ("<reasoning>" in completion or "</reasoning>" in completion) else 1.0
    return 0.0


def _judge(completion: str, reference: str, extraction: str, name: str) -> tuple[bool, bool, str | None]:
    """``(correct, format_ok, extracted)`` shared by every registered reward."""
    from gtpo_megatron.rewards.math_answer import grade  # math-verify: imported where grading happens

    verdict = grade(completion, reference, extraction=extraction, decimal_abs_tol=decimal_tolerance(name))
    format_ok = paper_format_score(completion) == PAPER_FORMAT_SCORE
    return verdict.correct, format_ok, verdict.extracted


@register_reward("math_verify")
def math_verify_reward(*, completion: str, reference: str, extraction: str = STRICT) -> RewardResult:
    """1.0 when the extracted answer is equivalent to the reference, else 0.0."""
    correct, format_ok, extracted = _judge(completion, reference, extraction, "math_verify")
    return RewardResult(score=float(correct), correct=correct, format_ok=format_ok, extracted=extracted)


@register_reward("format")
def format_reward(*, completion: str, reference: str, extraction: str = STRICT) -> RewardResult:
    """1.0 when the completion has the strict reasoning/answer format, else 0.0."""
    correct, format_ok, extracted = _judge(completion, reference, extraction, "format")
    return RewardResult(score=float(format_ok), correct=correct, format_ok=format_ok, extracted=extracted)


@register_reward(
    "paper", score_range=(0.0, PAPER_FORMAT_SCORE + PAPER_CORRECT_SCORE), decimal_abs_tol=PAPER_DECIMAL_TOLERANCE
)
def paper_reward(*, completion: str, reference: str, extraction: str = STRICT) -> RewardResult:
    """The authors' format + correctness reward; total in {0, 1, 1.5, 10, 20} (docs/algorithm.md section 6)."""
    correct, format_ok, extracted = _judge(completion, reference, extraction, "paper")
    score = paper_format_score(completion)
    if format_ok and correct:
        score += PAPER_CORRECT_SCORE
    return RewardResult(score=score, correct=correct, format_ok=format_ok, extracted=extracted)
