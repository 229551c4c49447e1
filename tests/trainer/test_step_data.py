"""Step assembly: PromptCompletions + rewards -> TrainBatch, advantages, entropy filter and conflict weights."""

from __future__ import annotations

import math

import pytest
import torch

from gtpo_megatron.config import PRESETS, AlgorithmConfig
from gtpo_megatron.rollout.types import Completion, PromptCompletions
from gtpo_megatron.step_data import (
    choose_groups,
    collate_completions,
    compute_step_weights,
    mismatch_sums,
    rollout_metrics,
    shape_rewards,
    shard_rows,
    weight_metrics,
)

EOS = 2


def _group(prompt, responses, finish=None):
    finish = finish or ["stop"] * len(responses)
    return PromptCompletions(prompt_ids=prompt, completions=[
        Completion(token_ids=r, rollout_logprobs=[-0.5] * len(r), text="", finish_reason=f)
        for r, f in zip(responses, finish)])


def _algorithm(name="gtpo", **kw):
    preset = {k: v for k, v in PRESETS[name].items() if k != "overlong_buffer_len"}
    return AlgorithmConfig(name=name, **{**preset, "group_size": 4, **kw})


def test_collate_right_pads_and_builds_masks_from_lengths():
    batch = collate_completions([_group([7, 8], [[5, EOS], [6]], ["stop", "length"]), _group([9], [[4, 4, EOS], []])],
                                pad_token_id=EOS)
    assert batch.input_ids.tolist() == [[7, 8, 5, EOS], [7, 8, 6, EOS], [9, 4, 4, EOS], [9, EOS, EOS, EOS]]
    assert batch.attention_mask.int().tolist() == [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert batch.response_mask.int().tolist() == [[0, 0, 1, 1], [0, 0, 1, 0], [0, 1, 1, 1], [0, 0, 0, 0]]
    assert batch.group_ids.tolist() == [0, 0, 1, 1]
    assert batch.extras["truncated"].tolist() == [False, True, False, False]
    assert batch.extras["rollout_logprobs"][0].tolist() == [0.0, 0.0, -0.5, -0.5]


def test_collate_rejects_ragged_groups():
    with pytest.raises(ValueError, match="same number of completions"):
        collate_completions([_group([1], [[3]]), _group([1], [[3], [4]])], pad_token_id=0)


def _conflict_batch():
    # One prompt, G=4: completions 0,1 correct (A>0), 2,3 wrong (A<0). All start with token 11; 0 and 2 also end
    # with "12 EOS"; 3 ends with EOS only.
    responses = [[11, 20, 12, EOS], [11, 21, EOS], [11, 30, 12, EOS], [11, 31, 32, EOS]]
    return collate_completions([_group([1, 1], responses)], pad_token_id=EOS)


def test_gtpo_weights_hand_computed():
    batch = _conflict_batch()
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0])
    entropy = torch.tensor([0.1, 0.2, 0.3, 0.4])
    weights = compute_step_weights(batch, rewards, entropy, _algorithm(), initial_entropy=1.0)
    # GTPO_SPEC section 2: A = r - mean = +-0.5; section 4: A - 0.1 <H>.
    assert weights.raw_advantages.tolist() == [0.5, 0.5, -0.5, -0.5]
    torch.testing.assert_close(weights.advantages, torch.tensor([0.49, 0.48, -0.53, -0.54]))
    # initial entropy 1.0 > ln 2: the paper filter keeps everything.
    assert weights.keep_mask.all()
    # Section 3, prefix_suffix, columns = [prompt, prompt, r0, r1, r2, r3]: prefix run = position 0 (token 11);
    # suffix runs aligned at each end: EOS is shared by P+ and P- at the last position; "12" one before it in
    # completions 0 (P+) and 2 (P-) only -> conflict; completion 1's "21" vs P- "32"/"12": no.
    expected = torch.tensor([
        [0, 0, 2, 1, 2, 2],
        [0, 0, 2, 1, 2, 0],
        [0, 0, 0, 1, 0, 0],
        [0, 0, 0, 1, 1, 0],
    ], dtype=torch.float32)
    torch.testing.assert_close(weights.token_weights, expected)
    metrics = weight_metrics(weights, batch.response_mask)
    # positive conflict tokens: 3 + 2 = 5 of 15 response tokens; negative: 3 + 2 = 5.
    assert metrics["gtpo/conflict_frac_pos"] == pytest.approx(5 / 15)
    assert metrics["gtpo/conflict_frac_neg"] == pytest.approx(5 / 15)
    assert metrics["gtpo/filtered_frac"] == 0.0


def test_paper_filter_drops_high_entropy_and_still_defines_conflicts():
    batch = _conflict_batch()
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0])
    entropy = torch.tensor([0.1, 0.9, 0.3, math.log(2)])  # completion 1 above ln 2; completion 3 exactly at ln 2
    weights = compute_step_weights(batch, rewards, entropy, _algorithm(), initial_entropy=0.5)
    assert weights.keep_mask.tolist() == [True, False, True, True]  # ties count as below (section 4)
    assert weights.token_weights[1].abs().sum() == 0
    assert weights.token_weights[0, 2].item() == 2.0  # conflicts still use the filtered completion
    excluded = compute_step_weights(batch, rewards, entropy, _algorithm(exclude_filtered_from_conflicts=True),
                                    initial_entropy=0.5)
    # Without completion 1, completion 0 still shares token 11 and "12 EOS" with completion 2.
    assert excluded.token_weights[0].tolist() == [0, 0, 2, 1, 2, 2]
    assert weight_metrics(weights, batch.response_mask)["gtpo/filtered_frac"] == 0.25


def test_grpo_preset_gives_std_advantages_and_plain_weights():
    batch = _conflict_batch()
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0])
    weights = compute_step_weights(batch, rewards, torch.full((4,), 5.0), _algorithm("grpo"), initial_entropy=None)
    std = torch.tensor([1.0, 1.0, 0.0, 0.0], dtype=torch.float64).std()
    torch.testing.assert_close(weights.advantages, (torch.tensor([0.5, 0.5, -0.5, -0.5]) / std).float(),
                               atol=1e-5, rtol=0)  # eps=1e-6 in the denominator
    torch.testing.assert_close(weights.token_weights, batch.response_mask.float())


def test_uniform_group_skip_and_overlong_filter():
    batch = collate_completions([_group([1], [[5, EOS], [6, EOS]]), _group([1], [[5, EOS], [6]], ["stop", "length"])],
                                pad_token_id=EOS)
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0])
    cfg = _algorithm(group_size=2, skip_uniform_groups=True, overlong_filter=True)
    weights = compute_step_weights(batch, rewards, torch.zeros(4), cfg, initial_entropy=1.0)
    assert weights.keep_mask.tolist() == [False, False, True, True]
    assert weights.token_weights.sum(dim=-1).tolist() == [0.0, 0.0, 2.0, 0.0]  # row 3 truncated


def test_shape_rewards_overlong_ramp():
    cfg = _algorithm("dapo", overlong_buffer_len=4, overlong_penalty=1.0)
    lengths = torch.tensor([5, 6, 8, 10])
    # L_max=10, L_cache=4: no penalty up to 6, then linear to -1 at 10.
    assert shape_rewards(torch.ones(4), lengths, cfg, max_tokens=10).tolist() == [1.0, 1.0, 0.5, 0.0]
    assert shape_rewards(torch.ones(4), lengths, _algorithm("grpo"), max_tokens=10).tolist() == [1.0] * 4


def test_choose_groups_prefers_varied_then_fills():
    assert choose_groups([False, True, False, True, True], 2) == [1, 3]
    assert choose_groups([False, True, False], 2) == [0, 1]


def test_shard_rows_and_mismatch_sums():
    batch = _conflict_batch()
    shard = shard_rows(batch, dp_rank=1, dp_size=2)
    assert torch.equal(shard.input_ids, batch.input_ids[2:])
    with pytest.raises(ValueError, match="does not split"):
        shard_rows(batch, dp_rank=0, dp_size=3)
    mask = torch.tensor([[True, True, False]])
    sums = mismatch_sums(torch.tensor([[-1.0, -2.0, 9.0]]), torch.tensor([[-1.5, -2.0, 0.0]]), mask)
    assert sums["abs_logprob_diff"].item() == pytest.approx(0.5)
    assert sums["prob_ratio_err"].item() == pytest.approx(math.exp(0.5) - 1)
    assert sums["count"].item() == 2


def test_rollout_metrics():
    batch = _conflict_batch()
    m = rollout_metrics(batch, torch.tensor([20.0, 10.0, 0.0, 0.0]), torch.tensor([True, False, False, False]),
                        torch.tensor([True, True, False, False]))
    assert (m["reward/mean"], m["accuracy"], m["format_rate"]) == (7.5, 0.25, 0.5)
    assert m["response/length_mean"] == 3.75 and m["response/length_max"] == 4
