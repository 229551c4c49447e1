"""``gtpo_megatron.parallel.collectives`` with ``group=None`` (single replica); the gloo versions are in
``tests/distributed/test_ops_tensor_parallel.py``."""

from __future__ import annotations

import pytest
import torch

from gtpo_megatron.ops import compute_normalizer
from gtpo_megatron.parallel import (
    all_gather_rows,
    all_reduce_,
    all_reduce_sum,
    any_rank,
    barrier,
    broadcast_,
    broadcast_object,
    global_mean,
    global_normalizer,
    reduce_metric_sums,
)
from gtpo_megatron.plan.layout import row_shard
from tests.helpers.batches import conflict_batch


def test_local_statistics():
    mask = torch.tensor([[True, True, False], [False, False, False], [True, False, False]])
    local = compute_normalizer(mask, "token-mean") + compute_normalizer(mask[:1], "token-mean")
    normalizer = global_normalizer(local, group=None)
    assert normalizer.item() == 5.0 and normalizer is not local
    empty = compute_normalizer(mask[1:2], "token-mean")
    assert global_normalizer(empty, group=None).item() == 0.0  # empty step: the caller skips it
    values = torch.tensor([1.0, 2.0, 6.0])
    assert global_mean(values, group=None).item() == 3.0
    assert global_mean(values, group=None, mask=torch.tensor([True, False, True])).item() == 3.5
    assert global_mean(values, group=None, mask=torch.zeros(3, dtype=torch.bool)).item() == 0.0
    summed = reduce_metric_sums({"b": torch.tensor(2.0), "a": torch.tensor(1)}, group=None)
    assert summed == {"a": torch.tensor(1.0), "b": torch.tensor(2.0)}
    source = torch.ones(2)
    out = all_reduce_sum(source, group=None)
    out += 1
    assert torch.equal(source, torch.ones(2))  # a copy, never the input
    buffer = torch.tensor([2.0, 3.0])
    assert all_reduce_(buffer, op="max", group=None) is buffer and broadcast_(buffer, src=0, group=None) is buffer
    assert buffer.tolist() == [2.0, 3.0]


def test_row_shard_is_the_one_data_parallel_row_layout():
    assert [row_shard(8, rank=r, size=4) for r in range(4)] == [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)]
    assert row_shard(3, rank=0, size=1) == slice(0, 3)
    with pytest.raises(ValueError, match=r"batch of 6 rows does not split over dp_size=4"):
        row_shard(6, rank=0, size=4)
    batch = conflict_batch()  # 4 rows
    assert torch.equal(batch.select(row_shard(4, rank=1, size=2)).input_ids, batch.input_ids[2:])


def test_single_process_control_messages():
    local = torch.tensor([0.5, 1.5])
    gathered = all_gather_rows(local, group=None)
    assert gathered.dtype == torch.float32 and torch.equal(gathered, local)
    assert broadcast_object({"a": 1}, src=0, group=None) == {"a": 1}
    assert any_rank(True, group=None) is True and any_rank(False, group=None) is False
    barrier(group=None)  # one process: nothing to wait for


def test_global_mean_on_one_replica_is_the_plain_mean():
    # <H>_ini goes through global_mean: on one data-parallel replica it is bit-identical to values[mask].mean()
    gen = torch.Generator().manual_seed(0)
    for size in (4, 96, 4096):
        values, mask = torch.rand(size, generator=gen) * 3, torch.rand(size, generator=gen) > 0.2
        assert global_mean(values, group=None, mask=mask).item() == values[mask].mean().item()
