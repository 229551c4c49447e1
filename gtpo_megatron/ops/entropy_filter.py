"""The entropy filter delta_i and the entropy penalty (docs/algorithm.md section 4).

B sequences, T token columns (response layout or the full ``[B, S]`` one). Entropies are in nats. ``<H>_ini`` of the
``paper`` mode is a global statistic the caller measures and passes in. Pure torch, no host syncs.
"""

from __future__ import annotations

import math

import torch

from gtpo_megatron.choices import ENTROPY_FILTER_MODES

LN2 = math.log(2.0)


def sequence_mean_entropy(entropy: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``<H>_i``: ``[B, T]`` token entropy (nats; NaN off the mask ignored) -> ``[B]`` fp32 detached mean, 0 if empty.

    Raises:
        ValueError: shape mismatch or non-bool ``response_mask``.
    """
    if tuple(entropy.shape) != tuple(response_mask.shape) or entropy.dim() != 2:
        raise ValueError(
            f"entropy {tuple(entropy.shape)} and response_mask {tuple(response_mask.shape)} must both be [B, T]"
        )
    if response_mask.dtype != torch.bool:
        raise ValueError(f"response_mask must be bool (True = response token); got {response_mask.dtype}")
    total_B = torch.where(response_mask, entropy.detach().float(), 0.0).sum(dim=-1)
    return total_B / response_mask.sum(dim=-1).clamp(min=1)


def entropy_keep_mask(
    seq_entropy: torch.Tensor,
    *,
    mode: str,
    threshold: float = LN2,
    initial_entropy: torch.Tensor | float | None = None,
    advantages: torch.Tensor | None = None,
    only_negative: bool = False,
) -> torch.Tensor:
    """delta_i of docs/algorithm.md section 4: ``[B]`` <H>_i (nats) -> ``[B]`` bool, True = keep; ties are kept.

    Raises:
        ValueError: unknown mode, ``threshold <= 0``, ``paper`` without ``initial_entropy``, ``only_negative``
            without ``[B]`` ``advantages``.
    """
    if mode not in ENTROPY_FILTER_MODES:
        raise ValueError(f"unknown entropy filter mode {mode!r}; choose one of {list(ENTROPY_FILTER_MODES)}")
    if seq_entropy.dim() != 1:
        raise ValueError(f"seq_entropy must be [B]; got shape {tuple(seq_entropy.shape)}")
    if not threshold > 0:
        raise ValueError(f"threshold={threshold} must be > 0 nats (ln 2 = {LN2:.4f} in the paper)")
    keep_B = seq_entropy <= threshold
    if mode == "off":
        keep_B = torch.ones_like(keep_B)
    elif mode == "paper":
        if initial_entropy is None:
            raise ValueError(
                "entropy filter mode 'paper' needs initial_entropy (<H>_ini of the first step); "
                "compute it with gtpo_megatron.parallel.global_mean and pass it"
            )
        initial = torch.as_tensor(initial_entropy, dtype=torch.float32, device=seq_entropy.device)
        keep_B = keep_B | (initial > threshold)
    if only_negative:
        if advantages is None or tuple(advantages.shape) != tuple(seq_entropy.shape):
            raise ValueError(
                "only_negative=True needs advantages [B] matching seq_entropy "
                f"{tuple(seq_entropy.shape)}; got {None if advantages is None else advantages.shape}"
            )
        keep_B = keep_B | (advantages >= 0)
    return keep_B


def apply_entropy_penalty(advantages: torch.Tensor, seq_entropy: torch.Tensor, gamma: float) -> torch.Tensor:
    """``[B]`` fp32 ``A_i - gamma * <H>_i`` (docs/algorithm.md section 4), a new tensor.

    Raises:
        ValueError: shape mismatch or ``gamma < 0``.
    """
    if tuple(advantages.shape) != tuple(seq_entropy.shape) or advantages.dim() != 1:
        raise ValueError(
            f"advantages {tuple(advantages.shape)} and seq_entropy {tuple(seq_entropy.shape)} must both be [B]"
        )
    if gamma < 0:
        raise ValueError(f"gamma={gamma} must be >= 0 (the paper ablates 0.1 .. 1e-6)")
    return advantages.float() - gamma * seq_entropy.detach().float()
