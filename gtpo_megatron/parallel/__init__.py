"""Distributed glue: collectives over explicit groups (``collectives``) and the group handle (``groups``).

Only ``collectives`` is re-exported here: ``groups`` imports megatron and must be imported explicitly
(``from gtpo_megatron.parallel.groups import ParallelGroups``).
"""

from __future__ import annotations

from gtpo_megatron.parallel.collectives import (
    all_gather_object,
    all_gather_rows,
    all_reduce_,
    all_reduce_sum,
    any_rank,
    barrier,
    broadcast_,
    broadcast_object,
    global_mean,
    global_normalizer,
    group_device,
    reduce_metric_sums,
)

__all__ = [
    "all_gather_object",
    "all_gather_rows",
    "all_reduce_",
    "all_reduce_sum",
    "any_rank",
    "barrier",
    "broadcast_",
    "broadcast_object",
    "global_mean",
    "global_normalizer",
    "group_device",
    "reduce_metric_sums",
]
