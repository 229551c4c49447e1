"""DAPO's overlong handling (Yu et al. 2025, arXiv 2503.14476; docs/algorithm.md section 5), pure functions.

Two stages: the soft overlong punishment (eq. 13) added to the task scores after the rollout (:func:`shape_rewards`,
:func:`overlong_penalty`), and overlong filtering, which drops truncated completions from the loss at collation
(:func:`overlong_filter_mask`). Inputs may be lists or tensors; outputs are CPU tensors; masks are bool, True keeps.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from gtpo_megatron.config import AlgorithmConfig


def overlong_penalty(
    lengths: Sequence[int] | torch.Tensor, max_len: int, cache_len: int, penalty: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment (eq. 13) times ``penalty``: 0 up to L_max - L_cache, then a ramp to -1 at L_max.

    ``lengths``: ``[B]`` response tokens (EOS included); ``max_len`` L_max; ``cache_len`` L_cache in ``[1, L_max]``
    (else ValueError); ``penalty`` >= 0 (else ValueError). Returns ``[B]`` fp32 in ``[-penalty, 0]``.
    """
    if not 1 <= cache_len <= max_len:
        raise ValueError(f"cache_len={cache_len} must be in [1, max_len={max_len}]; DAPO uses max_len/4 or so")
    if penalty < 0:
        raise ValueError(f"penalty={penalty} must be >= 0 (it is subtracted from the reward)")
    lengths_B = torch.as_tensor(lengths, dtype=torch.float64).reshape(-1)
    ramp_B = ((max_len - cache_len) - lengths_B) / cache_len
    shaped_B = torch.clamp(ramp_B, min=-1.0, max=0.0)
    return (shaped_B * penalty).to(torch.float32)


def shape_rewards(
    scores: torch.Tensor, response_lengths: torch.Tensor, cfg: AlgorithmConfig, *, max_tokens: int, reward_span: float
) -> torch.Tensor:
    """``[B]`` fp32 rewards: task ``scores`` plus DAPO's overlong penalty when ``cfg.overlong_buffer_len > 0``.

    The penalty at L_max = ``max_tokens`` is ``cfg.overlong_penalty * reward_span`` (``rewards.reward_span``), so the
    shaping weighs the same against a 0/1 or a 0-20 reward (docs/algorithm.md section 5).
    """
    rewards = scores.float()
    if cfg.overlong_buffer_len > 0:
        buffer = min(cfg.overlong_buffer_len, max_tokens)
        penalty = cfg.overlong_penalty * reward_span
        rewards = rewards + overlong_penalty(response_lengths, max_tokens, buffer, penalty)
    return rewards


def overlong_filter_mask(finish_reasons: Sequence[str]) -> torch.Tensor:
    """``[B]`` bool, False for truncated completions (``finish_reason == "length"``), True otherwise (keep)."""
    return torch.tensor([reason != "length" for reason in finish_reasons], dtype=torch.bool)
