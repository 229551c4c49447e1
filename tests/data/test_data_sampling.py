"""DAPO helpers against hand-computed values (arXiv 2503.14476 eq. 13 for the overlong penalty)."""

from __future__ import annotations

import pytest
import torch

from gtpo_megatron.data import (
    choose_groups,
    filter_uniform_groups,
    overlong_filter_mask,
    overlong_penalty,
    shape_rewards,
)
from gtpo_megatron.data.dynamic_sampling import UNIFORM_REWARD_ATOL
from gtpo_megatron.rewards import reward_span
from tests.helpers.batches import algorithm_section


def test_filter_uniform_groups_literal() -> None:
    rewards = [1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 20.0, 20.0, 10.0, 0.0, 0.0, 1e-9]
    keep = filter_uniform_groups(rewards, group_size=3)
    assert keep.dtype == torch.bool
    assert keep.tolist() == [False, True, True, False]  # last group differs by 1e-9 < atol: uniform
    assert filter_uniform_groups(torch.tensor(rewards), 3, atol=0.0).tolist() == [False, True, True, True]
    assert filter_uniform_groups([1.0, 2.0], 2).repeat_interleave(2).tolist() == [True, True]


def test_per_completion_view_of_the_uniform_rule() -> None:
    # the view the algorithm's skip_uniform_groups switch uses; 0.35 twice is uniform, so is 2 vs 2 + 1e-9 (< atol)
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.35, 0.35, 2.0, 2.0 + 1e-9])
    keep = filter_uniform_groups(rewards, 2).repeat_interleave(2)
    assert keep.tolist() == [False, False, True, True, False, False, False, False]
    assert UNIFORM_REWARD_ATOL == 1e-6


def test_filter_uniform_groups_errors() -> None:
    assert filter_uniform_groups([1.0, 2.0], 1).tolist() == [False, False]  # a single completion is uniform
    with pytest.raises(ValueError, match="group_size=0"):
        filter_uniform_groups([1.0, 2.0], 0)
    with pytest.raises(ValueError, match="len\\(rewards\\)=5 is not a multiple of group_size=2"):
        filter_uniform_groups([1.0] * 5, 2)


def test_overlong_penalty_matches_eq_13() -> None:
    # L_max = 100, L_cache = 20: no penalty up to 80, linear ramp to -1 at 100, -1 beyond.
    lengths = [0, 50, 80, 81, 90, 99, 100, 101, 500]
    expected = [0.0, 0.0, 0.0, -1 / 20, -10 / 20, -19 / 20, -1.0, -1.0, -1.0]
    got = overlong_penalty(lengths, max_len=100, cache_len=20)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, torch.tensor(expected), atol=1e-7, rtol=0)
    torch.testing.assert_close(overlong_penalty(torch.tensor([90]), 100, 20, penalty=10.0), torch.tensor([-5.0]))


def test_overlong_penalty_errors() -> None:
    with pytest.raises(ValueError, match="cache_len=0"):
        overlong_penalty([1], 100, 0)
    with pytest.raises(ValueError, match="cache_len=101"):
        overlong_penalty([1], 100, 101)
    with pytest.raises(ValueError, match="penalty=-1"):
        overlong_penalty([1], 100, 10, penalty=-1.0)


def test_overlong_filter_mask() -> None:
    mask = overlong_filter_mask(["stop", "length", "stop", "length"])
    assert mask.dtype == torch.bool and mask.tolist() == [True, False, True, False]
    assert overlong_filter_mask([]).shape == (0,)


def test_shape_rewards_overlong_ramp():
    cfg = algorithm_section("dapo", overlong_buffer_len=4, overlong_penalty=1.0)
    lengths = torch.tensor([5, 6, 8, 10])
    # L_max=10, L_cache=4: no penalty up to 6, then linear to -1 at 10 (a 0/1 reward: span 1).
    assert shape_rewards(torch.ones(4), lengths, cfg, max_tokens=10, reward_span=1.0).tolist() == [1.0, 1.0, 0.5, 0.0]
    grpo = algorithm_section("grpo")
    assert shape_rewards(torch.ones(4), lengths, grpo, max_tokens=10, reward_span=1.0).tolist() == [1.0] * 4


def test_overlong_penalty_scales_with_the_reward_range():
    # DAPO's penalty of 1 on a 0/1 reward is 20 on the paper's 0-20 reward (rewards.reward_span).
    cfg = algorithm_section("dapo", overlong_buffer_len=4, overlong_penalty=1.0)
    lengths = torch.tensor([5, 8, 10])
    span = reward_span("paper")
    assert span == 20.0 and reward_span("math_verify") == 1.0 and reward_span("format") == 1.0
    shaped = shape_rewards(torch.full((3,), 20.0), lengths, cfg, max_tokens=10, reward_span=span)
    assert shaped.tolist() == [20.0, 10.0, 0.0]


def test_choose_groups_prefers_varied_then_fills():
    assert choose_groups([False, True, False, True, True], 2) == [1, 3]
    assert choose_groups([False, True, False], 2) == [0, 1]
