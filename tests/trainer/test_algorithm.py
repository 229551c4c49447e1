"""One step's GTPO weights (``algorithm.py``): advantages, entropy filter and conflict weights, by hand."""

from __future__ import annotations

import math

import pytest
import torch

from gtpo_megatron.algorithm import compute_step_weights, weight_metrics
from gtpo_megatron.ops import compute_normalizer
from gtpo_megatron.parallel import global_normalizer
from gtpo_megatron.rollout.batch import collate_completions
from tests.helpers.batches import EOS, algorithm_section, conflict_batch, make_group


def test_gtpo_weights_hand_computed():
    batch = conflict_batch()
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0])
    entropy = torch.tensor([0.1, 0.2, 0.3, 0.4])
    weights = compute_step_weights(batch, rewards, entropy, algorithm_section(), initial_entropy=1.0)
    # GTPO_SPEC section 2: A = r - mean = +-0.5; section 4: A - 0.1 <H>.
    assert weights.raw_advantages.tolist() == [0.5, 0.5, -0.5, -0.5]
    torch.testing.assert_close(weights.advantages, torch.tensor([0.49, 0.48, -0.53, -0.54]))
    # initial entropy 1.0 > ln 2: the paper filter keeps everything.
    assert weights.keep_mask.all()
    # Section 3, prefix_suffix, columns = [prompt, prompt, r0, r1, r2, r3]: prefix run = position 0 (token 11);
    # suffix runs aligned at each end: EOS is shared by P+ and P- at the last position; "12" one before it in
    # completions 0 (P+) and 2 (P-) only -> conflict; completion 1's "21" vs P- "32"/"12": no.
    expected = torch.tensor(
        [
            [0, 0, 2, 1, 2, 2],
            [0, 0, 2, 1, 2, 0],
            [0, 0, 0, 1, 0, 0],
            [0, 0, 0, 1, 1, 0],
        ],
        dtype=torch.float32,
    )
    torch.testing.assert_close(weights.token_weights, expected)
    metrics = weight_metrics(weights, batch.response_mask)
    # positive conflict tokens: 3 + 2 = 5 of 15 response tokens; negative: 3 + 2 = 5.
    assert metrics["gtpo/conflict_frac_pos"] == pytest.approx(5 / 15)
    assert metrics["gtpo/conflict_frac_neg"] == pytest.approx(5 / 15)
    assert metrics["gtpo/filtered_frac"] == 0.0


def test_paper_filter_drops_high_entropy_and_still_defines_conflicts():
    batch = conflict_batch()
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0])
    entropy = torch.tensor([0.1, 0.9, 0.3, math.log(2)])  # completion 1 above ln 2; completion 3 exactly at ln 2
    weights = compute_step_weights(batch, rewards, entropy, algorithm_section(), initial_entropy=0.5)
    assert weights.keep_mask.tolist() == [True, False, True, True]  # ties count as below (section 4)
    assert weights.token_weights[1].abs().sum() == 0
    assert weights.token_weights[0, 2].item() == 2.0  # conflicts still use the filtered completion
    excluded = compute_step_weights(
        batch, rewards, entropy, algorithm_section(exclude_filtered_from_conflicts=True), initial_entropy=0.5
    )
    # Without completion 1, completion 0 still shares token 11 and "12 EOS" with completion 2.
    assert excluded.token_weights[0].tolist() == [0, 0, 2, 1, 2, 2]
    assert weight_metrics(weights, batch.response_mask)["gtpo/filtered_frac"] == 0.25


def test_grpo_preset_gives_std_advantages_and_plain_weights():
    batch = conflict_batch()
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0])
    weights = compute_step_weights(
        batch, rewards, torch.full((4,), 5.0), algorithm_section("grpo"), initial_entropy=None
    )
    std = torch.tensor([1.0, 1.0, 0.0, 0.0], dtype=torch.float64).std()
    torch.testing.assert_close(
        weights.advantages, (torch.tensor([0.5, 0.5, -0.5, -0.5]) / std).float(), atol=1e-5, rtol=0
    )  # eps=1e-6 in the denominator
    torch.testing.assert_close(weights.token_weights, batch.response_mask.float())


def test_uniform_group_skip_and_overlong_filter():
    batch = collate_completions(
        [make_group([1], [[5, EOS], [6, EOS]]), make_group([1], [[5, EOS], [6]], ["stop", "length"])], pad_token_id=EOS
    )
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0])
    cfg = algorithm_section(group_size=2, skip_uniform_groups=True, overlong_filter=True)
    weights = compute_step_weights(batch, rewards, torch.zeros(4), cfg, initial_entropy=1.0)
    assert weights.loss_row_mask.tolist() == [False, False, True, False]  # row 3 truncated
    assert weights.keep_mask.all()  # delta_i is the entropy filter's alone
    assert weights.token_weights.sum(dim=-1).tolist() == [0.0, 0.0, 2.0, 0.0]
    assert weight_metrics(weights, batch.response_mask)["gtpo/removed_frac"] == 0.75
    # one uniform-group rule (data.sampling.filter_uniform_groups, atol 1e-6) for this switch and dynamic sampling
    nearly_equal = torch.tensor([1.0, 1.0 + 1e-9, 1.0, 0.0])
    weights = compute_step_weights(batch, nearly_equal, torch.zeros(4), cfg, initial_entropy=1.0)
    assert weights.loss_row_mask.tolist() == [False, False, True, False]


def _issue_batch(finish=("stop", "stop", "stop", "stop")):
    """Issue 12 item 5: group 0 with 5 and 1 response tokens, group 1 with 3 and 3 (G = 2)."""
    group0 = make_group([1], [[5, 5, 5, 5, EOS], [EOS]], list(finish[:2]))
    group1 = make_group([1], [[6, 6, EOS], [7, 7, EOS]], list(finish[2:]))
    return collate_completions([group0, group1], pad_token_id=EOS)


def _step_normalizer(batch, rewards, entropy, cfg, *, max_response_length=None, initial_entropy=1.0):
    """The normaliser the policy uses for this step: ``global_normalizer`` on the batch's ``loss_mask``."""
    weights = compute_step_weights(batch, rewards, entropy, cfg, initial_entropy=initial_entropy)
    batch.token_weights, batch.loss_row_mask = weights.token_weights, weights.loss_row_mask
    local = compute_normalizer(batch.loss_mask, cfg.aggregation, max_response_length=max_response_length)
    normalizer = global_normalizer(local, group=None)
    return float(normalizer), weights


@pytest.mark.parametrize(
    "aggregation,max_response_length,expected,without_switch",
    [
        ("token-mean", None, 6.0, 12.0),  # the issue's input: group 1's 3 + 3 tokens
        ("seq-mean-token-mean", None, 2.0, 4.0),  # removed rows do not count as sequences
        ("seq-mean-token-sum", None, 2.0, 4.0),
        ("seq-mean-token-sum", 8, 16.0, 32.0),  # Dr. GRPO's constant: kept sequences x L
    ],
)
def test_skipped_uniform_groups_leave_the_normaliser(aggregation, max_response_length, expected, without_switch):
    rewards = torch.tensor([0.0, 0.0, 1.0, 0.0])
    cfg = algorithm_section("grpo", group_size=2, aggregation=aggregation, skip_uniform_groups=True)
    normalizer, weights = _step_normalizer(
        _issue_batch(), rewards, torch.zeros(4), cfg, max_response_length=max_response_length
    )
    assert normalizer == expected
    assert weights.loss_row_mask.tolist() == [False, False, True, True]
    off = algorithm_section("grpo", group_size=2, aggregation=aggregation)
    assert (
        _step_normalizer(_issue_batch(), rewards, torch.zeros(4), off, max_response_length=max_response_length)[0]
        == without_switch
    )


@pytest.mark.parametrize("aggregation,expected", [("token-mean", 3.0), ("seq-mean-token-mean", 1.0)])
def test_overlong_filtered_rows_leave_the_normaliser(aggregation, expected):
    # rows 0 (5 tokens) and 3 (3 tokens) truncated; group 0 is uniform too: only row 2 stays in the objective.
    batch = _issue_batch(finish=("length", "stop", "stop", "length"))
    cfg = algorithm_section(
        "grpo", group_size=2, aggregation=aggregation, skip_uniform_groups=True, overlong_filter=True
    )
    normalizer, weights = _step_normalizer(batch, torch.tensor([0.0, 0.0, 1.0, 0.0]), torch.zeros(4), cfg)
    assert normalizer == expected
    assert weights.loss_row_mask.tolist() == [False, False, True, False]


@pytest.mark.parametrize("aggregation,expected", [("seq-mean-token-mean", 4.0), ("token-mean", 12.0)])
def test_entropy_filtered_completions_still_count_in_the_normaliser(aggregation, expected):
    # GTPO_SPEC section 1: (1/G) sum_i delta_i (...) over ALL completions; row 1 (<H> = 0.9 > ln 2) has delta = 0
    # but counts (as a sequence, and with its 1 token under token-mean): 4 sequences / 5 + 1 + 3 + 3 tokens.
    cfg = algorithm_section("gtpo", group_size=2, aggregation=aggregation)
    entropy = torch.tensor([0.1, 0.9, 0.1, 0.1])
    normalizer, weights = _step_normalizer(
        _issue_batch(), torch.tensor([1.0, 0.0, 1.0, 0.0]), entropy, cfg, initial_entropy=0.5
    )
    assert weights.keep_mask.tolist() == [True, False, True, True]
    assert weights.token_weights[1].abs().sum() == 0
    assert normalizer == expected
