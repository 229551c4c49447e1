"""Group advantages vs literal values and the Python reference; registry rules."""

from __future__ import annotations

import pytest
import torch

from gtpo_megatron.ops import (
    ADVANTAGE_ESTIMATOR_REGISTRY,
    compute_group_advantages,
    get_advantage_estimator,
    register_advantage_estimator,
)
from tests.helpers.references import ref_group_advantages


def test_literal_group_mean_and_group_mean_std():
    rewards = torch.tensor([20.0, 0.0, 10.0, 1.0, 1.5, 1.5])
    # G=2: [20, 0] -> mean 10 -> [10, -10]; [10, 1] -> mean 5.5 -> [4.5, -4.5]; [1.5, 1.5] -> [0, 0]
    assert compute_group_advantages(rewards, 2).tolist() == [10.0, -10.0, 4.5, -4.5, 0.0, 0.0]
    # G=4 on [20, 0, 10, 1]: mean 7.75 -> [12.25, -7.75, 2.25, -6.75]
    assert compute_group_advantages(rewards[:4], 4).tolist() == [12.25, -7.75, 2.25, -6.75]
    # unbiased std = sqrt((150.0625 + 60.0625 + 5.0625 + 45.5625) / 3) = sqrt(86.916667) = 9.3229108
    std = compute_group_advantages(rewards[:4], 4, estimator="group_mean_std")
    torch.testing.assert_close(std, torch.tensor([12.25, -7.75, 2.25, -6.75]) / (9.3229108 + 1e-6))


@pytest.mark.parametrize("estimator", ["group_mean", "group_mean_std"])
def test_degenerate_groups_give_exact_zero(estimator):
    assert torch.equal(compute_group_advantages(torch.full((7,), 0.35), 7, estimator=estimator), torch.zeros(7))
    assert torch.equal(compute_group_advantages(torch.tensor([0.1 + 0.2] * 3), 3, estimator=estimator), torch.zeros(3))
    assert torch.equal(compute_group_advantages(torch.tensor([3.0, -1.0, 7.0]), 1, estimator=estimator), torch.zeros(3))
    near = compute_group_advantages(torch.tensor([0.1 + 0.2, 0.3], dtype=torch.float64), 2, estimator=estimator)
    assert torch.isfinite(near).all() and near.abs().max() < 1e-9  # 5.6e-17 apart: no blow-up


@pytest.mark.parametrize("estimator", ["group_mean", "group_mean_std"])
def test_random_matches_reference(estimator):
    rewards = torch.randint(0, 3, (24,)).double() * 10 + torch.rand(24).double()
    expected = ref_group_advantages(rewards.tolist(), 6, estimator)
    torch.testing.assert_close(
        compute_group_advantages(rewards, 6, estimator=estimator).double(),
        torch.tensor(expected, dtype=torch.float64),
        atol=1e-6,
        rtol=1e-6,
    )


def test_registry_rules_and_errors():
    assert {"group_mean", "group_mean_std"} <= set(ADVANTAGE_ESTIMATOR_REGISTRY)
    with pytest.raises(ValueError, match="already registered"):
        register_advantage_estimator("group_mean")(lambda *, rewards, eps: rewards)
    with pytest.raises(ValueError, match="group_mean_std"):
        get_advantage_estimator("nope")
    with pytest.raises(ValueError, match="divide"):
        compute_group_advantages(torch.zeros(5), 2)
    with pytest.raises(ValueError, match=r"\[B\]"):
        compute_group_advantages(torch.zeros(2, 2), 2)
