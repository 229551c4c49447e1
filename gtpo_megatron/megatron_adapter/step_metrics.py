"""Reduce the per-micro-batch metric dicts of one optimizer step to plain floats, identical on every rank.

Input: Megatron's ``forward_data_store`` (one dict of detached fp32 scalars per micro-batch, last PP stage only).
Keys ending in ``_max`` are reduced with MAX, the other (sums, counts) with SUM, over micro-batches then DP, then
broadcast from the last PP stage. Means are derived from the global sums.

Collectives (all through ``parallel.collectives``): one object broadcast on the PP group (key names), up to two
all-reduces on the DP group (SUM and MAX), one broadcast on the PP group; the PP ones only when ``pp_size > 1``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from gtpo_megatron.ops import means
from gtpo_megatron.parallel.collectives import all_reduce_, broadcast_, broadcast_object

if TYPE_CHECKING:
    from gtpo_megatron.parallel.groups import ParallelGroups

_STEP_MEANS = ("clip_frac", "ratio_mean", "kl_mean")  # of ops.MEANS (the entropy and filter means: the trainer's)


def _local_totals(store: list[dict[str, torch.Tensor]], keys: list[str]) -> torch.Tensor:
    values = []
    for key in keys:
        column = torch.stack([d[key].float().reshape(()) for d in store])
        values.append(column.max() if key.endswith("_max") else column.sum())
    return torch.stack(values)


def reduce_step_metrics(
    store: list[dict[str, torch.Tensor]], groups: ParallelGroups, *, device: torch.device
) -> dict[str, float]:
    """Global step metrics (see module docstring); every rank returns the same dict.

    ``store``: the schedule's return value (empty off the last PP stage); ``device``: of the collective buffers.
    Returns ``{key: float}`` plus the ``ops.MEANS`` (``clip_frac``, ``ratio_mean``, ``kl_mean``) whose sums exist.
    """
    keys = sorted(store[0]) if groups.is_last_pp_stage else None
    if groups.pp_size > 1:
        keys = broadcast_object(keys, src=groups.pp_last_global_rank, group=groups.pp)
    if groups.is_last_pp_stage:
        totals = _local_totals(store, keys).to(device)
        is_max = torch.tensor([k.endswith("_max") for k in keys], device=device)
        summed, maxed = totals.where(~is_max, 0.0), totals.where(is_max, float("-inf"))
        all_reduce_(summed, op="sum", group=groups.dp)
        if bool(is_max.any()):
            all_reduce_(maxed, op="max", group=groups.dp)
        totals = torch.where(is_max, maxed, summed)
    else:
        totals = torch.empty(len(keys), dtype=torch.float32, device=device)
    if groups.pp_size > 1:
        broadcast_(totals, src=groups.pp_last_global_rank, group=groups.pp)
    metrics = dict(zip(keys, totals.tolist()))
    return {**metrics, **means(metrics, _STEP_MEANS)}
