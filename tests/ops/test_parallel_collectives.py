"""``gtpo_megatron.parallel.collectives`` with ``group=None`` (single replica); the gloo versions are in
``tests/distributed/test_ops_tensor_parallel.py``."""

from __future__ import annotations

import pytest
import torch

from gtpo_megatron.parallel import all_reduce_sum, global_mean, global_normalizer, reduce_metric_sums


def test_local_statistics():
    mask = torch.tensor([[True, True, False], [False, False, False], [True, False, False]])
    assert global_normalizer([mask, mask[:1]], "token-mean", group=None).item() == 5.0
    assert global_normalizer([mask, mask[:1]], "seq-mean-token-mean", group=None).item() == 3.0
    assert global_normalizer([mask[1:2]], "token-mean", group=None).item() == 1.0  # clamped: empty step, loss 0
    assert global_normalizer([mask], "seq-mean-token-sum", group=None, max_response_length=4).item() == 8.0
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
    with pytest.raises(ValueError, match="response_masks is empty"):
        global_normalizer([], "token-mean", group=None)
