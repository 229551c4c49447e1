"""One step's GTPO weights (``algorithm.py``): advantages, entropy filter and conflict weights, by hand.

The entropy terms (delta_i, A_i - gamma <H>_i) are applied by ``ops.sequence_terms`` / ``ops.policy_objective``
(inside the training forward); these tests call ``sequence_terms`` on the same entropies where they check them.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from gtpo_megatron.algorithm import (
    build_loss_spec,
    compute_step_weights,
    conflict_metrics,
    needs_old_logprob_pass,
    objective_metrics,
    with_entropy_terms,
)
from gtpo_megatron.config import RolloutConfig
from gtpo_megatron.ops import compute_normalizer, sequence_terms
from gtpo_megatron.parallel import global_normalizer
from gtpo_megatron.rollout.batch import collate_completions
from tests.helpers.batches import EOS, algorithm_section, conflict_batch, make_group


def _spec(cfg, initial_entropy=None):
    return dataclasses.replace(build_loss_spec(cfg, RolloutConfig()), initial_entropy=initial_entropy)


def _weights(batch, rewards, cfg, *, seq_entropy=None, initial_entropy=None, scores=None):
    spec = _spec(cfg, initial_entropy)
    weights = compute_step_weights(batch, rewards, cfg, loss_spec=spec, seq_entropy=seq_entropy, scores=scores)
    return weights, spec


def test_gtpo_weights_hand_computed():
    batch = conflict_batch()
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0])
    entropy = torch.tensor([0.1, 0.2, 0.3, 0.4])
    weights, spec = _weights(batch, rewards, algorithm_section(), initial_entropy=1.0)
    # docs/algorithm.md section 2: A = r - mean = +-0.5; section 4: A - 0.1 <H> (applied by the objective).
    assert weights.raw_advantages.tolist() == [0.5, 0.5, -0.5, -0.5]
    terms = sequence_terms(entropy, weights.raw_advantages, spec, keep_mask=weights.loss_row_mask)
    torch.testing.assert_close(terms.advantages, torch.tensor([0.49, 0.48, -0.53, -0.54]))
    # initial entropy 1.0 > ln 2: the paper filter keeps everything.
    assert terms.keep_mask.all()
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
    metrics = conflict_metrics(weights, batch.response_mask)
    # positive conflict tokens: 3 + 2 = 5 of 15 response tokens; negative: 3 + 2 = 5.
    assert metrics["gtpo/conflict_frac_pos"] == pytest.approx(5 / 15)
    assert metrics["gtpo/conflict_frac_neg"] == pytest.approx(5 / 15)


def test_paper_filter_drops_high_entropy_and_still_defines_conflicts():
    batch = conflict_batch()
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0])
    entropy = torch.tensor([0.1, 0.9, 0.3, math.log(2)])  # completion 1 above ln 2; completion 3 exactly at ln 2
    weights, spec = _weights(batch, rewards, algorithm_section(), initial_entropy=0.5)
    terms = sequence_terms(entropy, weights.raw_advantages, spec, keep_mask=weights.loss_row_mask)
    assert terms.keep_mask.tolist() == [True, False, True, True]  # ties count as below (section 4)
    assert weights.token_weights[0, 2].item() == 2.0  # conflicts still use the filtered completion
    cfg = algorithm_section(exclude_filtered_from_conflicts=True)
    with pytest.raises(ValueError, match="need every completion's <H>_i before the update"):
        _weights(batch, rewards, cfg, initial_entropy=0.5)
    excluded, _ = _weights(batch, rewards, cfg, seq_entropy=entropy, initial_entropy=0.5)
    # Without completion 1, completion 0 still shares token 11 and "12 EOS" with completion 2.
    assert excluded.token_weights[0].tolist() == [0, 0, 2, 1, 2, 2]
    assert excluded.token_weights[1].tolist() == [0, 0, 1, 1, 1, 0]  # filtered: in neither P+ nor P-


def _sign_example():
    """docs/algorithm.md section 3's conflict_sign example: G=8, rewards [1.5]*7 + [1], every <H>_i = 0.7,
    [5,6,9,EOS] x7 and [5,6,8,EOS]."""
    batch = collate_completions([make_group([1], [[5, 6, 9, EOS]] * 7 + [[5, 6, 8, EOS]])], pad_token_id=EOS)
    return batch, torch.tensor([1.5] * 7 + [1.0]), torch.full((8,), 0.7)


def test_conflict_sign_raw_amplifies_a_row_whose_penalised_advantage_is_negative():
    batch, rewards, entropy = _sign_example()
    cfg = algorithm_section(group_size=8, entropy_filter="off")
    weights, spec = _weights(batch, rewards, cfg)
    terms = sequence_terms(entropy, weights.raw_advantages, spec)
    assert weights.raw_advantages[0].item() == pytest.approx(0.0625)
    assert terms.advantages[0].item() == pytest.approx(-0.0075)
    # P+ = rows 0-6 (A = +0.0625), P- = row 7: shared prefix 5, 6 and the shared EOS are amplified.
    assert weights.token_weights[0, 1:].tolist() == [2.0, 2.0, 1.0, 2.0]
    assert weights.token_weights[7, 1:].tolist() == [0.0, 0.0, 1.0, 0.0]
    assert not needs_old_logprob_pass(cfg, initial_entropy_known=False)


def test_conflict_sign_penalized_follows_the_sign_of_the_penalised_advantage():
    batch, rewards, entropy = _sign_example()
    cfg = algorithm_section(group_size=8, entropy_filter="off", conflict_sign="penalized")
    assert needs_old_logprob_pass(cfg, initial_entropy_known=True)  # lambda needs every <H>_i first
    weights, _ = _weights(batch, rewards, cfg, seq_entropy=entropy)
    # A - 0.1 * 0.7 < 0 for every row: P+ is empty, so there are no conflicts (section 3).
    assert weights.token_weights[0, 1:].tolist() == [1.0, 1.0, 1.0, 1.0]
    assert weights.token_weights[7, 1:].tolist() == [1.0, 1.0, 1.0, 1.0]
    assert conflict_metrics(weights, batch.response_mask)["gtpo/conflict_frac"] == 0.0


def test_conflict_frac_pos_counts_amplified_tokens_with_normalize_by_conflicts():
    batch = conflict_batch()
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0])
    cfg = algorithm_section(normalize_by_conflicts=True)
    weights, _ = _weights(batch, rewards, cfg, initial_entropy=1.0)
    # token weights are divided by max(1, n_i) (row 0: prefix run 1, suffix run 2 -> /2) ...
    assert weights.token_weights[0, 2:].tolist() == [1.0, 0.5, 1.0, 1.0]
    # ... but the metrics read the un-normalised lambda: still 5 amplified and 5 zeroed of 15 tokens.
    metrics = conflict_metrics(weights, batch.response_mask)
    assert metrics["gtpo/conflict_frac_pos"] == pytest.approx(5 / 15)
    assert metrics["gtpo/conflict_frac_neg"] == pytest.approx(5 / 15)


def test_grpo_preset_gives_std_advantages_and_plain_weights():
    batch = conflict_batch()
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0])
    weights, spec = _weights(batch, rewards, algorithm_section("grpo"))
    std = torch.tensor([1.0, 1.0, 0.0, 0.0], dtype=torch.float64).std()
    torch.testing.assert_close(
        weights.raw_advantages, (torch.tensor([0.5, 0.5, -0.5, -0.5]) / std).float(), atol=1e-5, rtol=0
    )  # eps=1e-6 in the denominator
    terms = sequence_terms(torch.full((4,), 5.0), weights.raw_advantages, spec)
    assert terms.keep_mask.all() and torch.equal(terms.advantages, weights.raw_advantages)  # no filter, no penalty
    torch.testing.assert_close(weights.token_weights, batch.response_mask.float())


def test_uniform_group_skip_and_overlong_filter():
    batch = collate_completions(
        [make_group([1], [[5, EOS], [6, EOS]]), make_group([1], [[5, EOS], [6]], ["stop", "length"])], pad_token_id=EOS
    )
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0])
    cfg = algorithm_section(group_size=2, skip_uniform_groups=True, overlong_filter=True)
    weights, _ = _weights(batch, rewards, cfg, initial_entropy=1.0)
    assert weights.loss_row_mask.tolist() == [False, False, True, False]  # row 3 truncated
    assert weights.keep_mask is None  # one row mask until the entropy terms are known (with_entropy_terms)
    assert weights.token_weights.sum(dim=-1).tolist() == [0.0, 0.0, 2.0, 0.0]
    assert conflict_metrics(weights, batch.response_mask)["gtpo/removed_frac"] == 0.75
    # one uniform-group rule (dynamic_sampling.filter_uniform_groups, atol 1e-6) for this switch and dynamic sampling
    nearly_equal = torch.tensor([1.0, 1.0 + 1e-9, 1.0, 0.0])
    weights, _ = _weights(batch, nearly_equal, cfg, initial_entropy=1.0)
    assert weights.loss_row_mask.tolist() == [False, False, True, False]


@pytest.mark.parametrize(
    ("fields", "known", "expected"),
    [
        ({}, True, False),  # GTPO after <H>_ini: everything in the training forward
        ({}, False, True),  # the paper filter measures <H>_ini first
        ({"entropy_filter": "fixed"}, False, False),
        ({"num_updates_per_batch": 2}, True, True),  # the ratio needs pi_old
        ({"exclude_filtered_from_conflicts": True}, True, True),
        ({"exclude_filtered_from_conflicts": True, "entropy_filter": "off"}, True, False),
        ({"conflict_sign": "penalized", "entropy_penalty": 0.0}, True, False),  # A - 0 * H = A
    ],
)
def test_needs_old_logprob_pass(fields, known, expected):
    assert needs_old_logprob_pass(algorithm_section(**fields), initial_entropy_known=known) is expected
    assert needs_old_logprob_pass(algorithm_section("grpo"), initial_entropy_known=False) is False


def test_objective_metrics_name_the_averages():
    sums = {
        "seq_entropy_sum": 1.5,
        "entropy_sum": 8.0,
        "num_sequences": 3.0,
        "num_tokens": 16.0,
        "filtered_sequences": 1.0,
        "advantage_abs_sum": 0.9,
        "mismatch_abs_logprob_diff": 0.8,
        "mismatch_prob_ratio_err": 1.6,
    }
    assert objective_metrics(sums) == pytest.approx(
        {
            "entropy/completion_mean": 0.5,  # mean over completions of <H>_i
            "entropy/token_mean": 0.5,  # mean over response tokens
            "gtpo/filtered_frac": 1 / 3,
            "advantage/abs_mean": 0.3,
            "mismatch/abs_logprob_diff": 0.05,
            "mismatch/prob_ratio_err": 0.1,
        }
    )
    assert "mismatch/abs_logprob_diff" not in objective_metrics({"num_tokens": 1.0})  # loss_temperature 1.0


def test_skip_uniform_groups_decides_on_scores_not_shaped_rewards():
    """G=2, scores [0, 0], lengths 20 and 10, max_tokens=20, overlong buffer 4: the overlong
    penalty shapes the rewards to [-1, 0], which look varied, but the group is uniform in score and is dropped."""
    from gtpo_megatron.data.overlong import shape_rewards

    batch = collate_completions(
        [make_group([1], [[5] * 19 + [EOS], [6] * 9 + [EOS]]), make_group([1], [[5, EOS], [6, EOS]])],
        pad_token_id=EOS,
    )
    cfg = algorithm_section(group_size=2, skip_uniform_groups=True, overlong_buffer_len=4)
    scores = torch.tensor([0.0, 0.0, 1.0, 0.0])
    rewards = shape_rewards(scores, torch.tensor([20, 10, 2, 2]), cfg, max_tokens=20, reward_span=1.0)
    assert rewards.tolist() == [-1.0, 0.0, 1.0, 0.0]  # the shaped group 0 looks varied
    weights, _ = _weights(batch, rewards, cfg, initial_entropy=1.0, scores=scores)
    assert weights.loss_row_mask.tolist() == [False, False, True, True]
    # the sibling: scores that vary while the shaped rewards are equal keep the group
    flipped, _ = _weights(batch, torch.zeros(4), cfg, initial_entropy=1.0, scores=torch.tensor([1.0, 0.0, 1.0, 0.0]))
    assert flipped.loss_row_mask.tolist() == [True, True, True, True]


def _issue_batch(finish=("stop", "stop", "stop", "stop")):
    """Group 0 with 5 and 1 response tokens, group 1 with 3 and 3 (G = 2)."""
    group0 = make_group([1], [[5, 5, 5, 5, EOS], [EOS]], list(finish[:2]))
    group1 = make_group([1], [[6, 6, EOS], [7, 7, EOS]], list(finish[2:]))
    return collate_completions([group0, group1], pad_token_id=EOS)


def _step_normalizer(batch, rewards, entropy, cfg, *, max_response_length=None, initial_entropy=1.0):
    """The normaliser the policy uses for this step: ``global_normalizer`` on the batch's ``loss_mask``.

    Also returns the step weights with the entropy terms of ``entropy`` applied (``algorithm.with_entropy_terms``).
    """
    weights, spec = _weights(batch, rewards, cfg, initial_entropy=initial_entropy)
    weights = with_entropy_terms(weights, entropy, spec)
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
    # docs/algorithm.md section 1: (1/G) sum_i delta_i (...) over ALL completions; row 1 (<H> = 0.9 > ln 2) has delta
    # = 0 but counts (as a sequence, and with its 1 token under token-mean): 4 sequences / 5 + 1 + 3 + 3 tokens.
    cfg = algorithm_section("gtpo", group_size=2, aggregation=aggregation)
    entropy = torch.tensor([0.1, 0.9, 0.1, 0.1])
    normalizer, weights = _step_normalizer(
        _issue_batch(), torch.tensor([1.0, 0.0, 1.0, 0.0]), entropy, cfg, initial_entropy=0.5
    )
    assert weights.keep_mask.tolist() == [True, False, True, True]
    assert weights.token_weights[1].abs().sum() == 0
    assert normalizer == expected
