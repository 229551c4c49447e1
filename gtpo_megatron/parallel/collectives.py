"""Global statistics over an explicit process group (STYLE section 3: statistics split from decisions).

Each function takes the group it reduces over as the keyword ``group``. ``group=None`` has exactly one meaning:
"this process is the whole reduction" (single process, or a statistic that is local by design); it never falls
back to the default world group. Every function returns a new tensor and leaves its inputs unmodified; the
collectives are SUM all-reduces (not differentiable), listed per function.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from gtpo_megatron.ops.losses import compute_normalizer


def all_reduce_sum(tensor: torch.Tensor, *, group: dist.ProcessGroup | None) -> torch.Tensor:
    """A copy of ``tensor`` summed over ``group``.

    Collectives: one SUM all-reduce on ``group`` (none when ``group`` is None).
    """
    out = tensor.detach().clone()
    if group is not None:
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


def global_normalizer(
    response_masks: Sequence[torch.Tensor],
    aggregation: str,
    *,
    group: dist.ProcessGroup | None,
    max_response_length: int | None = None,
) -> torch.Tensor:
    """The step's loss normaliser: ``compute_normalizer`` summed over micro-batches and the data-parallel group.

    Args:
        response_masks: this rank's micro-batch masks, each ``[b, T]`` bool (True = response token).
        aggregation: as ``gtpo_megatron.ops.compute_normalizer``.
        group: the data-parallel group of the step (None: single replica).
        max_response_length: Dr. GRPO's constant (see ``compute_normalizer``).

    Returns:
        fp32 scalar, identical on every rank of ``group``; clamped to >= 1 so an all-empty step gives loss 0.

    Collectives: one SUM all-reduce on ``group``.

    Raises:
        ValueError: empty ``response_masks`` or the errors of ``compute_normalizer``.
    """
    if len(response_masks) == 0:
        raise ValueError("response_masks is empty; pass the masks of every micro-batch of the step")
    local = sum(compute_normalizer(m, aggregation, max_response_length=max_response_length) for m in response_masks)
    return all_reduce_sum(local, group=group).clamp(min=1.0)


def global_mean(values: torch.Tensor, *, group: dist.ProcessGroup | None, mask: torch.Tensor | None = None):
    """Mean of ``values`` (``[n]``, optionally only where ``mask`` is True) over all ranks of ``group``.

    Used for ``<H>_ini``: ``global_mean(sequence_mean_entropy(H, response_mask), group=dp_group,
    mask=response_mask.any(-1))`` on the first step (GTPO_SPEC section 4, mode ``paper``).

    Returns:
        fp32 scalar; 0 when nothing is selected anywhere.

    Collectives: one SUM all-reduce of a 2-vector (sum, count) on ``group``.
    """
    keep = torch.ones_like(values, dtype=torch.bool) if mask is None else mask.bool()
    stats = torch.stack([torch.where(keep, values.detach().float(), 0.0).sum(), keep.sum(dtype=torch.float32)])
    stats = all_reduce_sum(stats, group=group)
    return stats[0] / stats[1].clamp(min=1.0)


def reduce_metric_sums(
    metrics: Mapping[str, torch.Tensor], *, group: dist.ProcessGroup | None
) -> dict[str, torch.Tensor]:
    """Sum a dict of scalar metric tensors (e.g. the losses' sums and counts) over ``group`` in one collective.

    Every rank must pass the same keys (sorted internally so the order cannot differ).

    Returns:
        dict with the same keys, fp32 scalars.

    Collectives: one SUM all-reduce of a ``[len(metrics)]`` vector on ``group``.
    """
    keys = sorted(metrics)
    if not keys:
        return {}
    stacked = torch.stack([metrics[k].detach().float().reshape(()) for k in keys])
    summed = all_reduce_sum(stacked, group=group)
    return {k: summed[i] for i, k in enumerate(keys)}
