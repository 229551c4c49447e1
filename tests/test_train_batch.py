"""``TrainBatch``, the one per-row record: every field travels through ``select`` and into a ``MicroBatch``."""

from __future__ import annotations

import dataclasses

import torch

from gtpo_megatron.batch import TrainBatch
from gtpo_megatron.megatron_adapter.forward_step import MicroBatch

B, S = 4, 3


def _full_record() -> TrainBatch:
    """Every field set, row r holding the value r (per-token fields: r in every column)."""
    values = {}
    for f in dataclasses.fields(TrainBatch):
        per_token = f.name not in ("truncated", "advantages", "loss_row_mask", "seq_entropy")
        column = torch.arange(B, dtype=torch.float32)
        values[f.name] = column[:, None].expand(B, S).clone() if per_token else column.clone()
    return TrainBatch(**values)


def test_select_cuts_every_field_and_keeps_unset_ones_unset():
    record = _full_record()
    rows = record.select(torch.tensor([3, 1]))
    for f in dataclasses.fields(TrainBatch):
        value = getattr(rows, f.name)
        assert value.shape[0] == 2 and value.reshape(2, -1)[:, 0].tolist() == [3.0, 1.0], f.name
    sparse = TrainBatch(input_ids=torch.zeros(B, S), response_mask=torch.ones(B, S, dtype=torch.bool))
    assert sparse.select(slice(1, 3)).advantages is None and sparse.select(slice(1, 3)).num_sequences == 2


def test_micro_batch_is_the_record_plus_the_model_inputs():
    extra = {f.name for f in dataclasses.fields(MicroBatch)} - {f.name for f in dataclasses.fields(TrainBatch)}
    assert extra == {"position_ids", "attention_mask", "source_rows", "layout", "packed_seq_params"}
    record = _full_record()
    positions = torch.arange(S).expand(B, -1)
    micro = MicroBatch.of(record, position_ids=positions, attention_mask=None)
    assert all(getattr(micro, f.name) is getattr(record, f.name) for f in dataclasses.fields(TrainBatch))
    cut = micro.select(slice(0, 2))  # the model inputs are not per-row fields: they stay as they are
    assert cut.position_ids is positions and cut.advantages.tolist() == [0.0, 1.0]


def test_loss_mask_is_the_response_mask_on_the_rows_in_the_objective():
    response = torch.tensor([[False, True, True], [False, True, False]])
    record = TrainBatch(input_ids=torch.zeros(2, 3, dtype=torch.long), response_mask=response)
    assert torch.equal(record.loss_mask, response)
    record.loss_row_mask = torch.tensor([True, False])
    assert record.loss_mask.tolist() == [[False, True, True], [False, False, False]]
