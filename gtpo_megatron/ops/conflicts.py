"""Conflict tokens and the per-token weights lambda (docs/algorithm.md section 3).

P prompts, G completions per prompt, B = P*G rows laid out group by group, T token columns (only those where
``response_mask`` is True are read), K = T aligned response positions. The k-th True column of a row is response
position k from the front, and counted from the right, position k from the completion's own end: padding side,
pad id and pad == EOS never matter. Conflicts never cross groups. Pure torch.
"""

from __future__ import annotations

import torch

from gtpo_megatron.choices import CONFLICT_MODES, OVERLAP_MODES


def _validate(response_ids, response_mask, advantages, group_size, mode, overlap) -> None:
    if response_ids.dim() != 2 or tuple(response_mask.shape) != tuple(response_ids.shape):
        raise ValueError(
            f"response_ids {tuple(response_ids.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must both be [B, T]"
        )
    if response_mask.dtype != torch.bool:
        raise ValueError(f"response_mask must be bool (True = response token); got {response_mask.dtype}")
    num_rows = response_ids.shape[0]
    if tuple(advantages.shape) != (num_rows,):
        raise ValueError(f"advantages has shape {tuple(advantages.shape)}; expected [B] = ({num_rows},)")
    if group_size < 1 or num_rows % group_size != 0:
        raise ValueError(f"group_size={group_size} must be >= 1 and divide B={num_rows} (rows group by group)")
    if mode not in CONFLICT_MODES:
        raise ValueError(f"unknown conflict mode {mode!r}; choose one of {list(CONFLICT_MODES)}")
    if overlap not in OVERLAP_MODES:
        raise ValueError(f"unknown overlap {overlap!r}; choose one of {list(OVERLAP_MODES)}")


def _aligned(ids_BT: torch.Tensor, mask_BT: torch.Tensor, from_end: bool):
    """Token ids re-laid by response position: ``[B, K]`` ids, ``[B, K]`` validity, ``[B, T]`` column->position."""
    num_cols = ids_BT.shape[1]
    position_BT = mask_BT.long().cumsum(dim=-1) - 1
    if from_end:
        position_BT = mask_BT.sum(dim=-1, keepdim=True) - 1 - position_BT
    target_BT = torch.where(mask_BT, position_BT, num_cols)  # padding goes to a scratch column, dropped below
    ids_BK = torch.full((ids_BT.shape[0], num_cols + 1), -1, dtype=ids_BT.dtype, device=ids_BT.device)
    ids_BK = ids_BK.scatter(1, target_BT, ids_BT)[:, :num_cols]
    valid_BK = torch.arange(num_cols, device=ids_BT.device) < mask_BT.sum(dim=-1, keepdim=True)
    return ids_BK, valid_BK, position_BT.clamp(0, max(num_cols - 1, 0))


def _raw_conflicts(ids_BK, valid_BK, positive_B, negative_B, group_size) -> torch.Tensor:
    """``[B, K]`` bool: the id at position k also sits at position k in one P+ and one P- completion of the group."""
    ids_PGK = ids_BK.reshape(-1, group_size, ids_BK.shape[-1])
    valid_PGK = valid_BK.reshape(ids_PGK.shape)
    same_PGGK = (ids_PGK.unsqueeze(2) == ids_PGK.unsqueeze(1)) & valid_PGK.unsqueeze(1)
    pos_P1G1 = positive_B.reshape(-1, 1, group_size, 1)
    neg_P1G1 = negative_B.reshape(-1, 1, group_size, 1)
    raw_PGK = valid_PGK & (same_PGGK & pos_P1G1).any(dim=2) & (same_PGGK & neg_P1G1).any(dim=2)
    return raw_PGK.reshape(ids_BK.shape)


def _leading_run(raw_BK: torch.Tensor) -> torch.Tensor:
    """``[B, K]`` bool: positions 0..k all raw-conflicting (the contiguous run from position 0)."""
    return raw_BK.long().cumprod(dim=-1).bool()


def _conflict_runs(response_ids, response_mask, advantages, group_size, mode):
    """Per-column conflict masks ``(front [B, T], back [B, T])`` and run lengths ``(front [B], back [B])``."""
    positive_B, negative_B = advantages > 0, advantages < 0
    masks, lengths = [], []
    for from_end in (False,) if mode == "any_position" else (False, True):
        ids_BK, valid_BK, position_BT = _aligned(response_ids, response_mask, from_end)
        conflict_BK = _raw_conflicts(ids_BK, valid_BK, positive_B, negative_B, group_size)
        if mode == "prefix_suffix":
            conflict_BK = _leading_run(conflict_BK)
        masks.append(response_mask & conflict_BK.gather(1, position_BT))
        lengths.append(conflict_BK.sum(dim=-1))
    if mode == "any_position":
        masks.append(torch.zeros_like(response_mask))
        lengths.append(torch.zeros_like(lengths[0]))
    return masks, lengths


def build_conflict_weights(
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    advantages: torch.Tensor,
    group_size: int,
    *,
    amplification: float = 2.0,
    mode: str = "prefix_suffix",
    overlap: str = "once",
) -> torch.Tensor:
    """``[B, T]`` fp32 lambda: w on P+ conflict tokens, 0 on P- ones, 1 on other response tokens, 0 elsewhere.

    ``response_ids`` ``[B, T]`` int and ``response_mask`` ``[B, T]`` bool; ``advantages`` ``[B]``, the raw A_i (only
    the sign is read; pass ``advantages * keep_mask`` to leave filtered completions out).

    Raises:
        ValueError: shape or dtype mismatches, ``group_size`` not dividing B, unknown ``mode``/``overlap``.
    """
    _validate(response_ids, response_mask, advantages, group_size, mode, overlap)
    (front_BT, back_BT), _ = _conflict_runs(response_ids, response_mask, advantages, group_size, mode)
    positive_B1 = (advantages > 0).unsqueeze(-1)
    negative_B1 = (advantages < 0).unsqueeze(-1)
    weights_BT = response_mask.to(torch.float32)
    amplified_BT = torch.full_like(weights_BT, float(amplification))
    if overlap == "multiply":
        amplified_BT = torch.where(front_BT & back_BT, amplified_BT * amplification, amplified_BT)
    conflict_BT = front_BT | back_BT
    weights_BT = torch.where(conflict_BT & positive_B1, amplified_BT, weights_BT)
    return torch.where(conflict_BT & negative_B1, torch.zeros_like(weights_BT), weights_BT)


def conflict_normalizers(
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    advantages: torch.Tensor,
    group_size: int,
    *,
    mode: str = "prefix_suffix",
) -> torch.Tensor:
    """``[B]`` fp32 divisors ``max(1, n_i)`` of ``normalize_by_conflicts`` (section 3); inputs and errors as above."""
    _validate(response_ids, response_mask, advantages, group_size, mode, "once")
    _, (front_B, back_B) = _conflict_runs(response_ids, response_mask, advantages, group_size, mode)
    signed_B = advantages != 0
    runs_B = torch.where(signed_B, torch.maximum(front_B, back_B), torch.zeros_like(front_B))
    return runs_B.clamp(min=1).to(torch.float32)
