"""DAPO's dynamic sampling (Yu et al. 2025, arXiv 2503.14476; docs/algorithm.md section 5): which groups a step keeps.

Notation: P prompts, G completions per prompt (``group_size``), B = P*G completions laid out group by group. A
uniform group (task scores all equal) has zero group-relative advantage: the rollout samples more prompts until the
step has ``num_prompts`` varied groups (:func:`choose_groups`), and ``algorithm.skip_uniform_groups`` drops them
from the loss; both decide with :func:`filter_uniform_groups` on the task scores, never on the shaped rewards (the
overlong penalty can spread the rewards of a group whose answers are all equally wrong).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

UNIFORM_REWARD_ATOL = 1e-6
"""Rewards within this distance of each other count as equal (one tolerance for every uniform-group decision)."""


def filter_uniform_groups(
    rewards: Sequence[float] | torch.Tensor, group_size: int, *, atol: float = UNIFORM_REWARD_ATOL
) -> torch.Tensor:
    """``[P]`` bool, True where a prompt group's task scores vary by more than ``atol`` (the one uniform-group rule).

    ``rewards``: ``[B]`` task scores grouped by prompt, B = P * ``group_size`` (G >= 1; at G = 1 every group is
    uniform). Raises ValueError on ``group_size < 1`` or B not a multiple of it.
    """
    rewards_B = torch.as_tensor(rewards, dtype=torch.float64).reshape(-1)
    if group_size < 1:
        raise ValueError(f"group_size={group_size} must be >= 1 (completions per prompt)")
    if rewards_B.numel() % group_size:
        raise ValueError(f"len(rewards)={rewards_B.numel()} is not a multiple of group_size={group_size}")
    rewards_PG = rewards_B.reshape(-1, group_size)
    spread_P = rewards_PG.max(dim=1).values - rewards_PG.min(dim=1).values
    return spread_P > atol


def choose_groups(varied: list[bool], num_prompts: int) -> list[int]:
    """DAPO dynamic sampling's pick of the step's ``num_prompts`` groups (indices, in sampling order).

    The first ``num_prompts`` groups with varied rewards, topped up with uniform groups (zero advantage) when the
    rounds ran out, so the batch shape never changes.
    """
    picked = [i for i, v in enumerate(varied) if v][:num_prompts]
    filler = [i for i, v in enumerate(varied) if not v][: num_prompts - len(picked)]
    return sorted(picked + filler)
