"""``megatron_adapter.micro_batching``: what each way of cutting a batch hands the model, value by value."""

from __future__ import annotations

import pytest
import torch

from gtpo_megatron.batch import TrainBatch
from gtpo_megatron.megatron_adapter.micro_batching import (
    budget_micro_batches,
    fixed_micro_batches,
    micro_batch_metrics,
)
from gtpo_megatron.plan.micro_batches import TokenBudget

CPU = torch.device("cpu")
LENGTHS = [5, 2, 7, 3]  # prompt 2 tokens each; row 1 has no response token


def _batch() -> TrainBatch:
    columns = torch.arange(8)
    token_mask = columns[None] < torch.tensor(LENGTHS)[:, None]
    return TrainBatch(
        input_ids=torch.arange(1, 33).reshape(4, 8) * token_mask,
        token_mask=token_mask,
        response_mask=token_mask & (columns[None] >= 2),
        advantages=torch.tensor([0.5, -1.0, 2.0, 0.25]),
        token_weights=token_mask.float() * 0.5,
    )


def test_micro_batching_packed_row_positions_and_block_diagonal_mask():
    (first, second) = budget_micro_batches(
        _batch(), TokenBudget(max_tokens=10, packing=True), width_multiple=4, backend="local", device=CPU
    )
    assert first.source_rows == (2, 3) and second.source_rows == (0, 1)  # 7 + 3 and 5 + 2 tokens
    assert first.input_ids.tolist() == [[17, 18, 19, 20, 21, 22, 23, 25, 26, 27, 0, 0]]  # 10 -> 12 (x4)
    assert first.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 0, 0]]
    assert first.advantages.tolist() == [2.0, 0.25]  # per-sequence tensors stay [n]
    mask = first.attention_mask[0, 0]  # True = masked
    assert not mask[9, 7] and mask[9, 6] and mask[7, 6]  # sequence 1 sees itself only
    assert not mask[6, 0] and mask[0, 1]  # causal inside sequence 0
    assert mask[10, 9] and not mask[10, 10] and mask[11, 10]  # a padding column sees only itself
    assert first.packed_seq_params is None  # the local spec reads the mask


def test_micro_batching_unpacked_restores_the_rows():
    batch = _batch()
    packed = budget_micro_batches(
        batch, TokenBudget(max_tokens=10, packing=True), width_multiple=1, backend="local", device=CPU
    )
    for micro_batch in packed:
        rows = torch.tensor(micro_batch.source_rows)
        unpacked = micro_batch.unpacked()
        width = max(LENGTHS[r] for r in micro_batch.source_rows)
        for name in ("input_ids", "token_mask", "response_mask", "token_weights"):
            assert torch.equal(getattr(unpacked, name), getattr(batch, name)[rows, :width]), name
        assert unpacked.layout is None and unpacked.attention_mask is None


def test_micro_batching_padded_to_each_micro_batch_longest():
    padded = budget_micro_batches(_batch(), TokenBudget(max_tokens=10), width_multiple=2, backend="local", device=CPU)
    # decreasing 7, 5, 3, 2: 5 next to 7 costs 14 > 10; 3 joins 5 (2 x 5 = 10); 2 fits nowhere (14, 15)
    assert [mb.source_rows for mb in padded] == [(2,), (0, 3), (1,)]
    assert [tuple(mb.input_ids.shape) for mb in padded] == [(1, 8), (2, 6), (1, 2)]
    assert padded[1].attention_mask is None  # unpacked rows: causal by the spec (SDPA's is_causal)


def test_micro_batching_fixed_rows_pad_the_last_micro_batch():
    fixed = fixed_micro_batches(_batch(), 3, width_multiple=3, backend="local", device=CPU)
    assert [mb.source_rows for mb in fixed] == [(0, 1, 2), (3, -1, -1)]
    assert fixed[1].input_ids.shape == (3, 9) and not fixed[1].response_mask[1:].any()


def test_micro_batching_thd_params_with_transformer_engine():
    pytest.importorskip("megatron.core")
    (first, _) = budget_micro_batches(
        _batch(), TokenBudget(max_tokens=10, packing=True), width_multiple=4, backend="transformer_engine", device=CPU
    )
    params = first.packed_seq_params
    assert first.attention_mask is None and params.qkv_format == "thd"
    assert params.cu_seqlens_q.tolist() == [0, 7, 10, 12]  # the 2 tail columns are one more segment
    assert params.max_seqlen_q == 7


def test_micro_batching_metrics_count_padding_and_shapes():
    padded = budget_micro_batches(_batch(), TokenBudget(max_tokens=10), width_multiple=1, backend="local", device=CPU)
    metrics = micro_batch_metrics(padded, group=None)
    # forward tokens 7 + 2 x 5 + 2 = 19, sequences 17
    assert metrics == pytest.approx(
        {"perf/micro_batches": 3, "perf/tokens_per_micro_batch_min": 2, "perf/tokens_per_micro_batch_max": 10,
         "perf/padding_frac": 2 / 19}
    )  # fmt: skip
    packed = budget_micro_batches(
        _batch(), TokenBudget(max_tokens=10, packing=True), width_multiple=1, backend="local", device=CPU
    )
    assert micro_batch_metrics(packed, group=None)["perf/padding_frac"] == 0.0
