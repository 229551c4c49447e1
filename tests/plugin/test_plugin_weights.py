"""``plugin.compute_gtpo_weights``: the trainer's own weights from plain tensors, padded and packed layouts."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gtpo_megatron import plugin
from gtpo_megatron.algorithm import build_loss_spec, compute_step_weights, with_entropy_terms
from gtpo_megatron.config import RolloutConfig
from tests.helpers.batches import algorithm_section, conflict_batch

REWARDS = torch.tensor([1.0, 1.0, 0.0, 0.0])
ENTROPY = torch.tensor([0.1, 0.9, 0.3, 0.4])
WEIGHT_FIELDS = ("raw_advantages", "advantages", "keep_mask", "conflict_weights", "token_weights", "loss_row_mask")


def test_same_weights_as_the_trainer():
    batch = conflict_batch()
    for cfg, initial in ((algorithm_section(), 0.5), (algorithm_section("grpo"), None)):
        ours = plugin.compute_gtpo_weights(
            batch.input_ids, batch.response_mask, REWARDS, ENTROPY, cfg, initial_entropy=initial
        )
        spec = dataclasses.replace(build_loss_spec(cfg, RolloutConfig()), initial_entropy=initial)
        trainer = with_entropy_terms(
            compute_step_weights(batch, REWARDS, cfg, loss_spec=spec, scores=REWARDS), ENTROPY, spec
        )
        for name in WEIGHT_FIELDS:
            assert torch.equal(getattr(ours, name), getattr(trainer, name)), name
    # the hand-computed case of tests/trainer/test_algorithm.py, filter active (completion 1 above ln 2)
    assert ours.advantages.shape == (4,) and ours.token_weights.shape == batch.input_ids.shape


def test_removed_rows_as_the_trainer():
    # overlong_filter removes truncated row 1 (loss_row_mask False: out of the loss and its normaliser, as in the
    # trainer); skip_uniform_groups removes the whole group when its rewards are equal. The entropy filter does not.
    batch = conflict_batch()
    batch.truncated = torch.tensor([False, True, False, False])
    cfg = algorithm_section(skip_uniform_groups=True, overlong_filter=True)
    for rewards, kept in ((REWARDS, [True, False, True, True]), (torch.ones(4), [False] * 4)):
        ours = plugin.compute_gtpo_weights(
            batch.input_ids, batch.response_mask, rewards, ENTROPY, cfg, initial_entropy=0.5,
            truncated=batch.truncated,
        )  # fmt: skip
        spec = dataclasses.replace(build_loss_spec(cfg, RolloutConfig()), initial_entropy=0.5)
        trainer = with_entropy_terms(
            compute_step_weights(batch, rewards, cfg, loss_spec=spec, scores=rewards), ENTROPY, spec
        )
        for name in WEIGHT_FIELDS:
            assert torch.equal(getattr(ours, name), getattr(trainer, name)), name
        assert ours.loss_row_mask.tolist() == kept
        assert ours.token_weights[~ours.loss_row_mask].abs().sum() == 0


def _packed(batch, starts: list[int], width: int):
    """The rows of ``batch`` (prompt + response, padding dropped) written at ``starts`` of one row of ``width``."""
    lengths = batch.token_mask.sum(dim=-1).tolist()
    layout = plugin.PackedLayout.of(starts, lengths)
    return layout, layout.pack(batch.input_ids, width), layout.pack(batch.response_mask, width)


def test_packed_row_gives_the_padded_weights():
    batch = conflict_batch()  # one group of 4: lengths 6, 5, 6, 6 (2 prompt tokens each)
    layout, ids, mask = _packed(batch, [0, 8, 13, 19], width=28)  # gaps at 6-7 and 25-27
    assert ids.shape == (1, 28) and mask.sum() == batch.response_mask.sum()
    cfg = algorithm_section()
    padded = plugin.compute_gtpo_weights(
        batch.input_ids, batch.response_mask, REWARDS, ENTROPY, cfg, initial_entropy=0.5
    )
    packed = plugin.compute_gtpo_weights(ids, mask, REWARDS, ENTROPY, cfg, initial_entropy=0.5, packed=layout)
    for name in ("raw_advantages", "advantages", "keep_mask", "loss_row_mask"):
        assert torch.equal(getattr(packed, name), getattr(padded, name)), name
    for name in ("conflict_weights", "token_weights"):
        assert getattr(packed, name).shape == (1, 28)
        assert torch.equal(getattr(packed, name), layout.pack(getattr(padded, name), 28)), name
    # written out: completion 0 sits at columns 2-5 with weights [2, 1, 2, 2] (its padded row, conflict case)
    assert packed.token_weights[0, 2:6].tolist() == [2.0, 1.0, 2.0, 2.0]
    assert packed.token_weights[0, 6:8].tolist() == [0.0, 0.0]


def test_refusals():
    batch = conflict_batch()
    with pytest.raises(ValueError, match="overlong_filter=true needs truncated"):
        plugin.compute_gtpo_weights(
            batch.input_ids, batch.response_mask, REWARDS, ENTROPY, algorithm_section(overlong_filter=True),
            initial_entropy=1.0,
        )  # fmt: skip
    with pytest.raises(ValueError, match="needs initial_entropy"):
        plugin.compute_gtpo_weights(batch.input_ids, batch.response_mask, REWARDS, ENTROPY, algorithm_section())
    _, ids, mask = _packed(batch, [0, 6, 11, 17], width=23)
    with pytest.raises(ValueError, match="rewards has 4 entries but response_ids holds 1 sequences.*packed="):
        plugin.compute_gtpo_weights(ids, mask, REWARDS, ENTROPY, algorithm_section(), initial_entropy=1.0)
    with pytest.raises(ValueError, match="one row"):
        layout = plugin.PackedLayout.of([0], [4])
        plugin.compute_gtpo_weights(batch.input_ids, batch.response_mask, REWARDS, ENTROPY, algorithm_section(),
                                    initial_entropy=1.0, packed=layout)  # fmt: skip
