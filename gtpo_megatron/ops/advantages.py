"""Group-relative advantage estimators and their registry (docs/algorithm.md section 2).

Dimension legend: P prompts, G completions per prompt (``group_size``), B = P*G sequences laid out group by group
(rows ``g*G .. g*G+G-1`` belong to prompt g).

Advantages are unitless (rewards' units for ``group_mean``, standardised for ``group_mean_std``). Estimators work
in float64 on rewards re-centred on each group's first reward, so that a group of equal rewards gives exactly 0
(never NaN) whatever the float values are (e.g. seven rewards of 0.35). Pure torch, inputs never modified.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch


class AdvantageEstimator(Protocol):
    """Keyword-only estimator signature.

    Args:
        rewards: ``[P, G]`` float64 rewards minus each group's first reward (equal rewards are exactly 0).
        eps: numerical floor added to denominators.

    Returns:
        ``[P, G]`` float64 advantages.
    """

    def __call__(self, *, rewards: torch.Tensor, eps: float) -> torch.Tensor:
        """Advantages of group-centred rewards (see the class docstring)."""
        ...


ADVANTAGE_ESTIMATOR_REGISTRY: dict[str, AdvantageEstimator] = {}


def register_advantage_estimator(name: str) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator adding an estimator to :data:`ADVANTAGE_ESTIMATOR_REGISTRY`.

    Raises:
        ValueError: if ``name`` is already registered.
    """

    def decorator(fn: AdvantageEstimator) -> AdvantageEstimator:
        if name in ADVANTAGE_ESTIMATOR_REGISTRY:
            raise ValueError(f"advantage estimator {name!r} is already registered; choose another name")
        ADVANTAGE_ESTIMATOR_REGISTRY[name] = fn
        return fn

    return decorator


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered as ``name``.

    Raises:
        ValueError: for an unknown name, listing the available ones.
    """
    if name not in ADVANTAGE_ESTIMATOR_REGISTRY:
        raise ValueError(f"unknown advantage estimator {name!r}; choose one of {sorted(ADVANTAGE_ESTIMATOR_REGISTRY)}")
    return ADVANTAGE_ESTIMATOR_REGISTRY[name]


@register_advantage_estimator("group_mean")
def group_mean(*, rewards: torch.Tensor, eps: float) -> torch.Tensor:
    """GTPO default (authors' code): ``A_i = r_i - mean_group(r)``; ``eps`` is unused."""
    return rewards - rewards.mean(dim=-1, keepdim=True)


@register_advantage_estimator("group_mean_std")
def group_mean_std(*, rewards: torch.Tensor, eps: float) -> torch.Tensor:
    """GRPO: ``(r_i - mean) / (std + eps)`` with the unbiased group std; groups of one give 0."""
    if rewards.shape[-1] < 2:
        return torch.zeros_like(rewards)
    centred = rewards - rewards.mean(dim=-1, keepdim=True)
    return centred / (rewards.std(dim=-1, keepdim=True) + eps)


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [B] (one reward per completion); got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.shape[0] % group_size != 0:
        raise ValueError(
            f"group_size={group_size} must be >= 1 and divide the number of rewards B={rewards.shape[0]}; "
            "lay rewards out group by group (B = P*G)"
        )
    return rewards.to(torch.float64).reshape(-1, group_size)


def compute_group_advantages(
    rewards: torch.Tensor, group_size: int, *, estimator: str = "group_mean", eps: float = 1e-6
) -> torch.Tensor:
    """Per-completion advantages relative to each prompt group (docs/algorithm.md section 2).

    Args:
        rewards: ``[B]`` any real dtype, laid out group by group (B = P*G).
        group_size: G.
        estimator: a key of :data:`ADVANTAGE_ESTIMATOR_REGISTRY` (``group_mean`` default, ``group_mean_std``).
        eps: denominator floor for std-normalised estimators.

    Returns:
        ``[B]`` fp32 advantages; exactly 0 for groups of one and for groups of equal rewards.

    Raises:
        ValueError: ``rewards`` not 1-D, ``group_size`` < 1 or not dividing B, unknown ``estimator``.
    """
    fn = get_advantage_estimator(estimator)
    rewards_PG = _grouped(rewards, group_size)
    centred_PG = rewards_PG - rewards_PG[:, :1]
    return fn(rewards=centred_PG, eps=eps).reshape(-1).to(torch.float32)
