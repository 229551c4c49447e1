"""Off-policy correction (docs/algorithm.md section 11): TIS / MIS weights by hand, in the loss vs float64."""

from __future__ import annotations

import math

import pytest
import torch

from gtpo_megatron.batch import TrainBatch
from gtpo_megatron.ops import LossSpec, compute_normalizer, importance_weights, policy_loss, policy_objective
from tests.helpers.references import ref_policy_loss

E, E_INV = math.e, math.exp(-1.0)
MASK = torch.tensor([[True, True, True, False], [True, True, False, False]])
PROXIMAL = torch.tensor([[-1.0, -0.5, -2.0, float("nan")], [-0.1, -3.0, 7.0, 7.0]])
BEHAVIOUR = torch.tensor([[-1.0, -1.5, -1.0, 0.0], [-0.4, -3.0, 0.0, 0.0]])
# rho = exp(prox - mu) on the response: [1, e, 1/e] and [exp(0.3), 1]; padding (even NaN) gives 0.
RATIO = [[1.0, E, E_INV, 0.0], [math.exp(0.3), 1.0, 0.0, 0.0]]


@pytest.mark.parametrize(
    ("mode", "cap", "weights", "capped"),
    [
        ("tis", 2.0, [[1.0, 2.0, E_INV, 0.0], [math.exp(0.3), 1.0, 0.0, 0.0]], [[0, 1, 0, 0], [0, 0, 0, 0]]),
        ("mis", 2.0, [[1.0, 0.0, E_INV, 0.0], [math.exp(0.3), 1.0, 0.0, 0.0]], [[0, 1, 0, 0], [0, 0, 0, 0]]),
        ("tis", 1.2, [[1.0, 1.2, E_INV, 0.0], [1.2, 1.0, 0.0, 0.0]], [[0, 1, 0, 0], [1, 0, 0, 0]]),
        ("mis", 1.2, [[1.0, 0.0, E_INV, 0.0], [0.0, 1.0, 0.0, 0.0]], [[0, 1, 0, 0], [1, 0, 0, 0]]),
        ("tis", 3.0, RATIO, [[0, 0, 0, 0], [0, 0, 0, 0]]),  # a cap above every rho: w = rho
    ],
)
def test_weights_by_hand_including_the_cap(mode, cap, weights, capped):
    out = importance_weights(PROXIMAL, BEHAVIOUR, MASK, mode=mode, cap=cap)
    torch.testing.assert_close(out.weights_BT.double(), torch.tensor(weights, dtype=torch.float64))
    torch.testing.assert_close(out.ratio_BT.double(), torch.tensor(RATIO, dtype=torch.float64))
    assert out.capped_BT.tolist() == torch.tensor(capped).bool().tolist()


def test_overflow_is_capped_by_tis_and_dropped_by_mis():
    prox, mu, mask = torch.tensor([[0.0, -1.0]]), torch.tensor([[-200.0, -1.0]]), torch.tensor([[True, True]])
    assert importance_weights(prox, mu, mask, mode="tis", cap=2.0).weights_BT.tolist() == [[2.0, 1.0]]
    assert importance_weights(prox, mu, mask, mode="mis", cap=2.0).weights_BT.tolist() == [[0.0, 1.0]]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(mode="none", cap=2.0), "mode='none'"),
        (dict(mode="tis", cap=0.0), "cap=0.0 must be > 0"),
    ],
)
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        importance_weights(PROXIMAL, BEHAVIOUR, MASK, **kwargs)
    with pytest.raises(ValueError, match=r"behaviour_logprobs_BT has shape \(2, 3\)"):
        importance_weights(PROXIMAL, BEHAVIOUR[:, :3], MASK, mode="tis", cap=2.0)


def _spec(correction="none", aggregation="seq-mean-token-mean", cap=2.0) -> LossSpec:
    return LossSpec(
        loss_name="gtpo",
        aggregation=aggregation,
        clip_eps_low=0.2,
        clip_eps_high=0.2,
        off_policy_correction=correction,
        off_policy_cap=cap,
    )


def _objective(spec, *, old=None, rollout=BEHAVIOUR):
    leaf = torch.tensor([[-1.0, -0.5, -2.0, 0.0], [-0.1, -3.0, 0.0, 0.0]], requires_grad=True)
    batch = TrainBatch(
        input_ids=torch.zeros(MASK.shape, dtype=torch.long),
        response_mask=MASK,
        rollout_logprobs=rollout,
        old_logprobs=old,
        advantages=torch.tensor([1.0, -2.0]),
        token_weights=torch.tensor([[2.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]]),
    )
    loss, metrics, _ = policy_objective(leaf, None, batch, spec, compute_normalizer(MASK, spec.aggregation))
    loss.backward()
    return loss, metrics, leaf.grad


def test_tis_one_update_by_hand():
    """r = 1 with gradient, w = min(exp(logp - mu), 2): loss = -(1/2)[(2*1 + 1*2 + 1/e)/3 - 2*(exp(.3)*1 + 0)/2]."""
    loss, metrics, grad = _objective(_spec("tis"))
    row0, row1 = (2.0 * 1.0 + 1.0 * 2.0 + E_INV) / 3, -2.0 * math.exp(0.3) / 2
    assert loss.item() == pytest.approx(-(row0 + row1) / 2, rel=1e-6)
    expected = [[-2.0 / 6, -2.0 / 6, -E_INV / 6, 0.0], [2.0 * math.exp(0.3) / 4, 0.0, 0.0, 0.0]]
    torch.testing.assert_close(grad.double(), torch.tensor(expected, dtype=torch.float64))  # w carries no gradient
    assert metrics["is_weight_sum"].item() == pytest.approx(1 + 2 + E_INV + math.exp(0.3) + 1, rel=1e-6)
    assert metrics["is_capped_tokens"].item() == 1.0


@pytest.mark.parametrize("correction", ["tis", "mis"])
@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "token-mean"])
def test_decoupled_ppo_matches_float64(correction, aggregation):
    """Several updates: the ratio is clipped against pi_old, w = pi_old / mu (decoupled PPO), vs the token loop."""
    old = torch.tensor([[-0.7, -0.9, -2.5, 0.0], [-0.2, -2.5, 0.0, 0.0]])
    spec = _spec(correction, aggregation, cap=1.5)
    loss, _, grad = _objective(spec, old=old)
    weights = importance_weights(old, BEHAVIOUR, MASK, mode=correction, cap=1.5).weights_BT
    policy64 = torch.tensor([[-1.0, -0.5, -2.0, 0.0], [-0.1, -3.0, 0.0, 0.0]], dtype=torch.float64)
    policy64.requires_grad_(True)
    expected = ref_policy_loss(
        policy64,
        old.double(),
        torch.tensor([1.0, -2.0], dtype=torch.float64),
        torch.tensor([[2.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]], dtype=torch.float64),
        [3, 2],
        aggregation=aggregation,
        normalizer=float(compute_normalizer(MASK, aggregation)),
        clip_low=0.2,
        clip_high=0.2,
        is_weights=weights.double(),
    )
    expected.backward()
    torch.testing.assert_close(loss.double(), expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad.double(), policy64.grad, atol=1e-6, rtol=1e-6)
    assert weights[0, 0].item() == pytest.approx(math.exp(0.3))  # the weights are pi_old's, not pi_theta's


def test_none_leaves_the_loss_bit_exact_and_correction_needs_behaviour_logprobs():
    plain = _objective(_spec("none"), rollout=None)
    with_rollout = _objective(_spec("none"))
    assert torch.equal(plain[0], with_rollout[0]) and torch.equal(plain[2], with_rollout[2])
    assert "is_weight_sum" not in with_rollout[1]
    with pytest.raises(ValueError, match=r"off_policy_correction='mis' needs the behaviour log-probs"):
        _objective(_spec("mis"), rollout=None)


def test_policy_loss_weights_only_the_surrogate_not_the_kl():
    policy = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    mask = torch.tensor([[True, True]])
    spec = LossSpec(loss_name="grpo", aggregation="token-mean", clip_eps_low=0.2, clip_eps_high=0.2, kl_coef=0.5)
    kwargs = dict(advantages=torch.tensor([1.0]), response_mask=mask, normalizer=torch.tensor(2.0), spec=spec)
    ref = torch.tensor([[-1.0, -2.0]])  # KL k3 is 0 at pi_ref = pi_theta, its gradient too
    loss, _ = policy_loss(
        policy_logprobs=policy, old_logprobs=None, token_weights=mask.float(), ref_logprobs=ref,
        is_weights=torch.tensor([[0.5, 0.0]]), **kwargs,
    )  # fmt: skip
    assert loss.item() == pytest.approx(-0.25)  # -(0.5 * 1 + 0 * 1) / 2
    with pytest.raises(ValueError, match=r"unknown off_policy_correction 'is'"):
        LossSpec(
            loss_name="gtpo", aggregation="token-mean", clip_eps_low=0.2, clip_eps_high=0.2, off_policy_correction="is"
        )


@pytest.mark.parametrize("mode", ["tis", "mis"])
def test_an_undefined_ratio_weighs_zero_and_is_flagged(mode):
    # NaN proximal, NaN behaviour, -inf on both sides: undefined; -inf behaviour alone: rho = inf, capped (tis: C)
    inf, nan = float("inf"), float("nan")
    prox, mu = torch.tensor([[nan, -0.5, -inf, 0.0, -1.0]]), torch.tensor([[-1.0, nan, -inf, -inf, -1.0]])
    out = importance_weights(prox, mu, torch.ones(1, 5, dtype=torch.bool), mode=mode, cap=2.0)
    assert out.undefined_BT.tolist() == [[True, True, True, False, False]]
    assert out.capped_BT.tolist() == [[False, False, False, True, False]]
    assert out.ratio_BT.tolist() == [[0.0, 0.0, 0.0, inf, 1.0]]
    assert out.weights_BT.tolist() == [[0.0, 0.0, 0.0, 2.0 if mode == "tis" else 0.0, 1.0]]


def test_an_undefined_proximal_token_leaves_the_objective_and_is_counted():
    """A NaN pi_old on a response token: its surrogate at ratio 1 with weight 0, so loss and gradient stay finite
    and equal the float64 loss without that token's weight; counted in ``is_undefined_tokens``."""
    old = torch.tensor([[float("nan"), -0.9, -2.5, 0.0], [-0.2, -2.5, 0.0, 0.0]])
    loss, metrics, grad = _objective(_spec("tis", cap=1.5), old=old)
    weights = importance_weights(old, BEHAVIOUR, MASK, mode="tis", cap=1.5).weights_BT
    assert weights[0, 0].item() == 0.0 and metrics["is_undefined_tokens"].item() == 1.0
    policy64 = torch.tensor([[-1.0, -0.5, -2.0, 0.0], [-0.1, -3.0, 0.0, 0.0]], dtype=torch.float64)
    policy64.requires_grad_(True)
    old64 = old.double().clone()
    old64[0, 0] = -1.0  # ratio 1 (any finite value: its weight is 0)
    expected = ref_policy_loss(
        policy64, old64, torch.tensor([1.0, -2.0], dtype=torch.float64),
        torch.tensor([[2.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]], dtype=torch.float64), [3, 2],
        aggregation="seq-mean-token-mean", normalizer=float(compute_normalizer(MASK, "seq-mean-token-mean")),
        clip_low=0.2, clip_high=0.2, is_weights=weights.double(),
    )  # fmt: skip
    expected.backward()
    torch.testing.assert_close(loss.double(), expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad.double(), policy64.grad, atol=1e-6, rtol=1e-6)
    assert grad[0, 0].item() == 0.0
