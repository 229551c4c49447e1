"""DAPO's sampling helpers (Yu et al. 2025, arXiv 2503.14476; docs/algorithm.md section 5), pure functions.

Notation: P prompts, G completions per prompt (``group_size``), B = P*G completions laid out group by group
(rows ``p*G .. p*G+G-1`` belong to prompt ``p``). Inputs may be lists or tensors; outputs are CPU tensors.
Masks are bool and True means keep.

- :func:`filter_uniform_groups`: dynamic sampling keeps only groups whose task scores are not all equal (a uniform
  group has zero group-relative advantage and no learning signal); the trainer then samples more prompts until
  the batch is full. Every variance decision takes the task scores, never the shaped rewards (the overlong
  penalty can spread the rewards of a group whose answers are all equally wrong).
- :func:`overlong_penalty`: soft overlong punishment, DAPO eq. 13, added to the task reward.
- :func:`overlong_filter_mask`: overlong filtering, drops truncated completions from the loss.
- :func:`shape_rewards`: task scores plus the overlong penalty, as the algorithm section configures it.
- :func:`choose_groups`: dynamic sampling's pick of the step's groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from gtpo_megatron.config import AlgorithmConfig


UNIFORM_REWARD_ATOL = 1e-6
"""Rewards within this distance of each other count as equal (one tolerance for every uniform-group decision)."""


def filter_uniform_groups(
    rewards: Sequence[float] | torch.Tensor, group_size: int, *, atol: float = UNIFORM_REWARD_ATOL
) -> torch.Tensor:
    """Which prompt groups have varied scores: the one uniform-group rule (docs/algorithm.md sections 4 and 5).

    Used by dynamic sampling and ``rollout/varied_group_frac`` (``rollout.collector``) and by
    ``algorithm.skip_uniform_groups`` (its per-completion view ``mask.repeat_interleave(group_size)``), always on
    the task scores, never on the shaped rewards.

    Args:
        rewards: ``[B]`` task scores, B = P * group_size, grouped by prompt. Not modified.
        group_size: G, completions per prompt (>= 1; with G = 1 every group is uniform, so all are dropped).
        atol: rewards within ``atol`` of each other count as equal (``max - min <= atol``).

    Returns:
        ``[P]`` bool, True for a group whose rewards are not all equal (keep), False for a uniform group (drop).
        Use ``mask.repeat_interleave(group_size)`` for a per-completion ``[B]`` mask.

    Raises:
        ValueError: if ``group_size < 1`` or ``B`` is not a multiple of ``group_size``.
    """
    rewards_B = torch.as_tensor(rewards, dtype=torch.float64).reshape(-1)
    if group_size < 1:
        raise ValueError(f"group_size={group_size} must be >= 1 (completions per prompt)")
    if rewards_B.numel() % group_size:
        raise ValueError(f"len(rewards)={rewards_B.numel()} is not a multiple of group_size={group_size}")
    rewards_PG = rewards_B.reshape(-1, group_size)
    spread_P = rewards_PG.max(dim=1).values - rewards_PG.min(dim=1).values
    return spread_P > atol


def overlong_penalty(
    lengths: Sequence[int] | torch.Tensor, max_len: int, cache_len: int, penalty: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment (eq. 13), scaled by ``penalty``.

    With L_max = ``max_len`` and L_cache = ``cache_len``, a completion of ``|y|`` tokens gets
    ``0`` if ``|y| <= L_max - L_cache``; ``((L_max - L_cache) - |y|) / L_cache`` if
    ``L_max - L_cache < |y| <= L_max``; ``-1`` if ``|y| > L_max``; all multiplied by ``penalty``.

    Args:
        lengths: ``[B]`` response lengths in tokens (EOS included, padding excluded). Not modified.
        max_len: L_max, the length the penalty reaches -1 (usually the sampling max_tokens), >= 1.
        cache_len: L_cache, the width of the linear ramp, 1 <= cache_len <= max_len.
        penalty: scale, >= 0 (DAPO uses 1.0 for 0/1 rewards; scale it with the reward range).

    Returns:
        ``[B]`` fp32 penalties in ``[-penalty, 0]``, to add to the rewards.

    Raises:
        ValueError: on ``cache_len`` outside ``[1, max_len]`` or a negative ``penalty``.
    """
    if not 1 <= cache_len <= max_len:
        raise ValueError(f"cache_len={cache_len} must be in [1, max_len={max_len}]; DAPO uses max_len/4 or so")
    if penalty < 0:
        raise ValueError(f"penalty={penalty} must be >= 0 (it is subtracted from the reward)")
    lengths_B = torch.as_tensor(lengths, dtype=torch.float64).reshape(-1)
    ramp_B = ((max_len - cache_len) - lengths_B) / cache_len
    shaped_B = torch.clamp(ramp_B, min=-1.0, max=0.0)
    return (shaped_B * penalty).to(torch.float32)


def overlong_filter_mask(finish_reasons: Sequence[str]) -> torch.Tensor:
    """``[B]`` bool, False for truncated completions (``finish_reason == "length"``), True otherwise (keep)."""
    return torch.tensor([reason != "length" for reason in finish_reasons], dtype=torch.bool)


def shape_rewards(
    scores: torch.Tensor, response_lengths: torch.Tensor, cfg: AlgorithmConfig, *, max_tokens: int, reward_span: float
) -> torch.Tensor:
    """Task scores plus DAPO's overlong penalty when ``cfg.overlong_buffer_len > 0`` (docs/algorithm.md section 5).

    The penalty at ``max_tokens`` is ``cfg.overlong_penalty * reward_span``: DAPO's 1 on a 0/1 reward becomes 20 on
    the paper's 0-20 reward, so the shaping weighs the same against the task reward whatever its scale.

    Args:
        scores: ``[B]`` reward-function scores.
        response_lengths: ``[B]`` response tokens per completion.
        cfg: the algorithm section (``overlong_buffer_len`` L_cache, ``overlong_penalty`` in reward-range units).
        max_tokens: L_max, the sampling limit.
        reward_span: highest minus lowest score of the reward function (``rewards.reward_span``), > 0.

    Returns:
        ``[B]`` fp32 rewards used for the advantages.
    """
    rewards = scores.float()
    if cfg.overlong_buffer_len > 0:
        buffer = min(cfg.overlong_buffer_len, max_tokens)
        penalty = cfg.overlong_penalty * reward_span
        rewards = rewards + overlong_penalty(response_lengths, max_tokens, buffer, penalty)
    return rewards


def choose_groups(varied: list[bool], num_prompts: int) -> list[int]:
    """DAPO dynamic sampling's pick of the step's ``num_prompts`` groups (indices, in sampling order).

    The first ``num_prompts`` groups with varied rewards, topped up with uniform groups (zero advantage) when the
    rounds ran out, so the batch shape never changes.
    """
    picked = [i for i, v in enumerate(varied) if v][:num_prompts]
    filler = [i for i, v in enumerate(varied) if not v][: num_prompts - len(picked)]
    return sorted(picked + filler)
