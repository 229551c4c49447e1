"""One step's GTPO weights (``algorithm.py``): advantages, entropy filter and conflict weights, by hand."""

from __future__ import annotations

import math

import pytest
import torch

from gtpo_megatron.algorithm import compute_step_weights, weight_metrics
from gtpo_megatron.rollout.batch import collate_completions
from tests.helpers.batches import EOS, algorithm_section, conflict_batch, make_group


def test_gtpo_weights_hand_computed():
    batch = conflict_batch()
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0])
    entropy = torch.tensor([0.1, 0.2, 0.3, 0.4])
    weights = compute_step_weights(batch, rewards, entropy, algorithm_section(), initial_entropy=1.0, scores=rewards)
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
    weights = compute_step_weights(batch, rewards, entropy, algorithm_section(), initial_entropy=0.5, scores=rewards)
    assert weights.keep_mask.tolist() == [True, False, True, True]  # ties count as below (section 4)
    assert weights.token_weights[1].abs().sum() == 0
    assert weights.token_weights[0, 2].item() == 2.0  # conflicts still use the filtered completion
    excluded = compute_step_weights(
        batch,
        rewards,
        entropy,
        algorithm_section(exclude_filtered_from_conflicts=True),
        initial_entropy=0.5,
        scores=rewards,
    )
    # Without completion 1, completion 0 still shares token 11 and "12 EOS" with completion 2.
    assert excluded.token_weights[0].tolist() == [0, 0, 2, 1, 2, 2]
    assert weight_metrics(weights, batch.response_mask)["gtpo/filtered_frac"] == 0.25


def test_grpo_preset_gives_std_advantages_and_plain_weights():
    batch = conflict_batch()
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0])
    weights = compute_step_weights(
        batch, rewards, torch.full((4,), 5.0), algorithm_section("grpo"), initial_entropy=None, scores=rewards
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
    weights = compute_step_weights(batch, rewards, torch.zeros(4), cfg, initial_entropy=1.0, scores=rewards)
    assert weights.keep_mask.tolist() == [False, False, True, True]
    assert weights.token_weights.sum(dim=-1).tolist() == [0.0, 0.0, 2.0, 0.0]  # row 3 truncated
    # one uniform-group rule (data.sampling.filter_uniform_groups, atol 1e-6) for this switch and dynamic sampling
    nearly_equal = torch.tensor([1.0, 1.0 + 1e-9, 1.0, 0.0])
    weights = compute_step_weights(batch, nearly_equal, torch.zeros(4), cfg, initial_entropy=1.0, scores=nearly_equal)
    assert weights.keep_mask.tolist() == [False, False, True, True]


def test_skip_uniform_groups_decides_on_scores_not_shaped_rewards():
    """Issue 12 item 6: G=2, scores [0, 0], lengths 20 and 10, max_tokens=20, overlong buffer 4: the overlong
    penalty shapes the rewards to [-1, 0], which look varied, but the group is uniform in score and is dropped."""
    from gtpo_megatron.data.sampling import shape_rewards

    batch = collate_completions(
        [make_group([1], [[5] * 19 + [EOS], [6] * 9 + [EOS]]), make_group([1], [[5, EOS], [6, EOS]])],
        pad_token_id=EOS,
    )
    cfg = algorithm_section(group_size=2, skip_uniform_groups=True, overlong_buffer_len=4)
    scores = torch.tensor([0.0, 0.0, 1.0, 0.0])
    rewards = shape_rewards(scores, torch.tensor([20, 10, 2, 2]), cfg, max_tokens=20)
    assert rewards.tolist() == [-1.0, 0.0, 1.0, 0.0]  # the shaped group 0 looks varied
    weights = compute_step_weights(batch, rewards, torch.zeros(4), cfg, initial_entropy=1.0, scores=scores)
    assert weights.keep_mask.tolist() == [False, False, True, True]
    assert weights.token_weights[:2].abs().sum() == 0
    # the sibling: scores that vary while the shaped rewards are equal keep the group
    flipped = compute_step_weights(
        batch, torch.zeros(4), torch.zeros(4), cfg, initial_entropy=1.0, scores=torch.tensor([1.0, 0.0, 1.0, 0.0])
    )
    assert flipped.keep_mask.tolist() == [True, True, True, True]
