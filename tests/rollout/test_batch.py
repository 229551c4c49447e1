"""Collation of PromptCompletions into a TrainBatch and the batch metrics."""

from __future__ import annotations

import pytest
import torch

from gtpo_megatron.rollout.batch import collate_completions, rollout_metrics
from tests.helpers.batches import EOS, conflict_batch, make_group


def test_collate_right_pads_and_builds_masks_from_lengths():
    batch = collate_completions(
        [make_group([7, 8], [[5, EOS], [6]], ["stop", "length"]), make_group([9], [[4, 4, EOS], []])], pad_token_id=EOS
    )
    assert batch.input_ids.tolist() == [[7, 8, 5, EOS], [7, 8, 6, EOS], [9, 4, 4, EOS], [9, EOS, EOS, EOS]]
    assert batch.token_mask.int().tolist() == [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert batch.response_mask.int().tolist() == [[0, 0, 1, 1], [0, 0, 1, 0], [0, 1, 1, 1], [0, 0, 0, 0]]
    assert batch.truncated.tolist() == [False, True, False, False]
    assert batch.rollout_logprobs[0].tolist() == [0.0, 0.0, -0.5, -0.5]


def test_collate_rejects_ragged_groups():
    with pytest.raises(ValueError, match="same number of completions"):
        collate_completions([make_group([1], [[3]]), make_group([1], [[3], [4]])], pad_token_id=0)


def test_rollout_metrics():
    batch = conflict_batch()
    m = rollout_metrics(
        batch,
        torch.tensor([20.0, 10.0, 0.0, 0.0]),
        torch.tensor([True, False, False, False]),
        torch.tensor([True, True, False, False]),
    )
    assert (m["reward/mean"], m["accuracy"], m["format_rate"]) == (7.5, 0.25, 0.5)
    assert m["response/length_mean"] == 3.75 and m["response/length_max"] == 4
