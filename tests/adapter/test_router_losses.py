"""``moe.router_losses``: each micro-batch's factor ``D r_m / R`` from its real tokens, whatever cut it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gtpo_megatron.batch import TrainBatch
from gtpo_megatron.megatron_adapter.micro_batching import budget_micro_batches, fixed_micro_batches
from gtpo_megatron.megatron_adapter.moe.router_losses import real_tokens, router_loss_factors
from gtpo_megatron.plan.micro_batches import TokenBudget

CPU = torch.device("cpu")
LENGTHS = [5, 2, 7, 3]


def _batch(token_mask: bool = True) -> TrainBatch:
    mask = torch.arange(8)[None] < torch.tensor(LENGTHS)[:, None]
    return TrainBatch(
        input_ids=torch.ones(4, 8, dtype=torch.long),
        token_mask=mask if token_mask else None,
        response_mask=mask,
        advantages=torch.zeros(4),
    )


def test_router_losses_factors_are_token_shares_under_every_cut():
    fixed = fixed_micro_batches(_batch(), 3, width_multiple=1, backend="local", device=CPU)  # rows 0-2, 3 + padding
    packed = budget_micro_batches(
        _batch(), TokenBudget(max_tokens=10, packing=True), width_multiple=4, backend="local", device=CPU
    )
    assert [real_tokens(mb) for mb in fixed] == [14, 3] and [real_tokens(mb) for mb in packed] == [10, 7]
    assert router_loss_factors(fixed, dp_group=None, dp_size=1) == pytest.approx([14 / 17, 3 / 17], abs=1e-15)
    assert router_loss_factors(packed, dp_group=None, dp_size=2) == pytest.approx([20 / 17, 14 / 17], abs=1e-15)


def test_router_losses_factors_without_token_mask_idle_and_empty():
    fixed = fixed_micro_batches(_batch(token_mask=False), 3, width_multiple=1, backend="local", device=CPU)
    assert [real_tokens(mb) for mb in fixed] == [24, 8]  # real rows x width: the padding row counts 0
    idle = dataclasses.replace(fixed[-1], source_rows=(-1,) * 3)
    assert router_loss_factors([*fixed, idle], dp_group=None, dp_size=1) == pytest.approx([0.75, 0.25, 0.0])
    assert router_loss_factors([idle], dp_group=None, dp_size=1) == [0.0]
