"""Rewards for math reasoning: answer extraction/equivalence, the reward registry and a timeout-safe worker pool.

Public API (stable; details in each module's docstring):

- ``get_reward(name)`` -> ``reward_fn(*, completion: str, reference: str) -> RewardResult`` with fields
  ``score: float``, ``correct: bool``, ``format_ok: bool``, ``extracted: str | None``. Names: ``math_verify``,
  ``format``, ``paper`` (GTPO_SPEC section 6). ``register_reward(name)`` adds one.
- ``RewardPool(reward_name, num_workers=2, timeout_s=5.0)``: ``.score(completions, references) -> (results,
  stats)``, ``.close()``, context manager.
- ``normalize_answer(text) -> str``: canonical answer string for maj@k voting.
- ``extract_answer``, ``answers_match``, ``reference_answer``: the pieces the rewards are built from.

Depends only on the stdlib and math-verify (no torch), so reward workers start fast.
"""

from __future__ import annotations

from gtpo_megatron.rewards.math_answer import answers_match, extract_answer, normalize_answer, reference_answer
from gtpo_megatron.rewards.pool import RewardPool
from gtpo_megatron.rewards.registry import REWARD_REGISTRY, RewardFn, RewardResult, get_reward, register_reward

__all__ = [
    "REWARD_REGISTRY",
    "RewardFn",
    "RewardPool",
    "RewardResult",
    "answers_match",
    "extract_answer",
    "get_reward",
    "normalize_answer",
    "reference_answer",
    "register_reward",
]
