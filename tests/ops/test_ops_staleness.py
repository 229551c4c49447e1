"""Per-token policy versions (docs/algorithm.md section 11, "Mixed versions"): the staleness bound vs float64."""

from __future__ import annotations

import math

import pytest
import torch

from gtpo_megatron.ops import importance_weights, staleness_mask, staleness_stats

# Two completions of 5 token columns; a weight update lands after the 3rd token of row 0 (versions 3 then 4) and
# row 1 was sampled by version 2 only (4 tokens, 1 padding column).
VERSIONS = torch.tensor([[3, 3, 3, 4, 4], [2, 2, 2, 2, 0]])
MASK = torch.tensor([[True] * 5, [True, True, True, True, False]])
PROXIMAL = torch.tensor([[-1.0, -0.5, -2.0, -0.2, -0.7], [-0.3, -1.1, -0.9, -2.5, 5.0]])
BEHAVIOUR = torch.tensor([[-1.2, -1.5, -1.0, -0.2, -0.6], [-0.4, -1.0, -0.9, -2.0, 0.0]])
ADVANTAGES = torch.tensor([0.5, -1.5])


def _reference_loss(policy_version: int, max_staleness: int, cap: float) -> float:
    """-sum(w * A) / kept tokens in float64, one token at a time (TIS weight, ratio 1: one update per batch)."""
    total, kept = 0.0, 0
    for i in range(2):
        for t in range(5):
            if not MASK[i, t] or policy_version - int(VERSIONS[i, t]) > max_staleness:
                continue
            rho = math.exp(float(PROXIMAL[i, t].double()) - float(BEHAVIOUR[i, t].double()))
            total -= min(rho, cap) * float(ADVANTAGES[i])
            kept += 1
    return total / kept


@pytest.mark.parametrize(("policy_version", "max_staleness", "kept"), [(4, 1, 5), (5, 1, 2), (5, 2, 5), (4, 2, 9)])
def test_an_update_mid_completion_masks_the_old_tokens_and_the_loss_matches_float64(policy_version, max_staleness,
                                                                                       kept):  # fmt: skip
    mask = staleness_mask(VERSIONS, MASK, policy_version=policy_version, max_staleness=max_staleness)
    assert int(mask.keep_BT.sum()) == kept
    assert mask.lag_BT[0].tolist() == [policy_version - 3] * 3 + [policy_version - 4] * 2  # v before, v+1 after
    assert mask.lag_BT[1, 4] == 0 and not mask.keep_BT[1, 4]  # padding: never kept, lag 0
    weights = importance_weights(PROXIMAL, BEHAVIOUR, mask.keep_BT, mode="tis", cap=2.0).weights_BT
    loss = -(weights * ADVANTAGES[:, None]).sum() / mask.keep_BT.sum()
    assert math.isclose(float(loss), _reference_loss(policy_version, max_staleness, 2.0), rel_tol=1e-6)


def test_the_version_histogram_counts_every_response_token_once():
    mask = staleness_mask(VERSIONS, MASK, policy_version=5, max_staleness=2)
    stats = staleness_stats(mask, MASK, max_staleness=2)
    assert stats["async/staleness_mean"] == pytest.approx((3 * 2 + 2 * 1 + 4 * 3) / 9)
    assert stats["async/staleness_max"] == 3.0
    assert stats["async/stale_token_frac"] == pytest.approx(4 / 9)
    lags = [stats[f"async/version_frac_lag{d}"] for d in range(3)]
    assert lags == pytest.approx([0.0, 2 / 9, 3 / 9])


@pytest.mark.parametrize(
    ("versions", "kwargs", "match"),
    [
        (VERSIONS, {"policy_version": 3, "max_staleness": 1}, r"sampled by a version after the trained one \(3\)"),
        (VERSIONS, {"policy_version": 5, "max_staleness": -1}, r"max_staleness=-1 must be >= 0"),
        (VERSIONS.float(), {"policy_version": 5, "max_staleness": 1}, r"token_versions_BT integer"),
        (VERSIONS[:, :4], {"policy_version": 5, "max_staleness": 1}, r"it must match response_mask_BT"),
    ],
)
def test_bad_inputs_are_refused(versions, kwargs, match):
    with pytest.raises(ValueError, match=match):
        staleness_mask(versions, MASK, **kwargs)
