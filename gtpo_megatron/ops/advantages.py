"""Group-relative advantage estimators and their registry (docs/algorithm.md section 2).

P prompts, G completions per prompt, B = P*G rows laid out group by group. Estimators work in float64 on rewards
re-centred on each group's first reward, so a group of equal rewards gives exactly 0, never NaN. Pure torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch


class AdvantageEstimator(Protocol):
    """Keyword-only estimator: ``[P, G]`` float64 group-centred rewards, ``eps`` floor -> ``[P, G]`` advantages."""

    def __call__(self, *, rewards: torch.Tensor, eps: float) -> torch.Tensor:
        """Advantages of group-centred rewards."""
        ...


ADVANTAGE_ESTIMATOR_REGISTRY: dict[str, AdvantageEstimator] = {}


def register_advantage_estimator(name: str) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator adding an estimator to :data:`ADVANTAGE_ESTIMATOR_REGISTRY`; ValueError if ``name`` is taken."""

    def decorator(fn: AdvantageEstimator) -> AdvantageEstimator:
        if name in ADVANTAGE_ESTIMATOR_REGISTRY:
            raise ValueError(f"advantage estimator {name!r} is already registered; choose another name")
        ADVANTAGE_ESTIMATOR_REGISTRY[name] = fn
        return fn

    return decorator


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered as ``name``; ValueError listing the known ones otherwise."""
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
    """``[B]`` rewards (any real dtype, group by group) -> ``[B]`` fp32 advantages; 0 for uniform groups.

    Raises:
        ValueError: ``rewards`` not 1-D, ``group_size`` < 1 or not dividing B, unknown ``estimator``.
    """
    fn = get_advantage_estimator(estimator)
    rewards_PG = _grouped(rewards, group_size)
    centred_PG = rewards_PG - rewards_PG[:, :1]
    return fn(rewards=centred_PG, eps=eps).reshape(-1).to(torch.float32)
