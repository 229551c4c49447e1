"""The policy loss vs the float64 token-loop reference, LossSpec's rules, micro-batch and padding invariance."""

from __future__ import annotations

import pytest
import torch

from gtpo_megatron.ops import KL_ESTIMATORS, LOSS_NAMES, LossSpec, compute_normalizer, policy_loss
from tests.helpers.references import ref_policy_loss

B, T = 8, 6


def _batch(seed=0, extra_pad=0):
    gen = torch.Generator().manual_seed(seed)
    lengths = [6, 1, 4, 0, 5, 3, 6, 2]
    mask = torch.arange(T + extra_pad)[None, :] < torch.tensor(lengths)[:, None]
    policy = (-torch.rand(B, T, generator=gen) * 3).double()
    old = policy + 0.3 * torch.randn(B, T, generator=gen).double()  # ratios well outside [0.8, 1.28]
    ref = policy + 0.2 * torch.randn(B, T, generator=gen).double()
    weights = torch.tensor([0.0, 1.0, 2.0])[torch.randint(0, 3, (B, T), generator=gen)].double()
    adv = torch.randn(B, generator=gen).double()
    if extra_pad:
        garbage = torch.full((B, extra_pad), float("nan"), dtype=torch.float64)
        policy, old, ref = (torch.cat([x, garbage], dim=1) for x in (policy, old, ref))
        weights = torch.cat([weights, torch.full((B, extra_pad), 5.0, dtype=torch.float64)], dim=1)
    return dict(policy=policy, old=old, ref=ref, weights=weights, adv=adv, mask=mask, lengths=lengths)


def _spec(name, aggregation, **fields) -> LossSpec:
    return LossSpec(loss_name=name, aggregation=aggregation, clip_eps_low=0.2, clip_eps_high=0.28, **fields)


def _call(
    name, b, normalizer, aggregation, *, rows=slice(None), kl_coef=0.0, old=True, dtype=torch.float32, estimator="k3"
):
    policy = b["policy"][rows].to(dtype).requires_grad_()
    spec = _spec(name, aggregation, kl_coef=kl_coef, kl_estimator=estimator)
    loss, metrics = policy_loss(
        policy_logprobs=policy,
        old_logprobs=b["old"][rows].to(dtype) if old else None,
        advantages=b["adv"][rows].to(dtype),
        token_weights=b["weights"][rows].to(dtype),
        response_mask=b["mask"][rows],
        normalizer=normalizer,
        spec=spec,
        ref_logprobs=b["ref"][rows].to(dtype),
    )
    loss.backward()
    return loss, metrics, policy.grad


CASES = [
    ("gtpo", "seq-mean-token-mean", 0.0),
    ("gtpo", "token-mean", 0.0),
    ("grpo", "seq-mean-token-mean", 0.05),
    ("dapo", "token-mean", 0.0),
    ("dr_grpo", "seq-mean-token-sum", 0.0),
]


@pytest.mark.parametrize("name,aggregation,kl_coef", CASES)
@pytest.mark.parametrize("old", [True, False])
def test_matches_reference_loss_and_gradient(name, aggregation, kl_coef, old):
    b = _batch()
    normalizer = compute_normalizer(b["mask"], aggregation) * 1.5  # as if other ranks held more data
    loss, _, grad = _call(name, b, normalizer, aggregation, kl_coef=kl_coef, old=old)
    policy64 = b["policy"].clone().requires_grad_()
    want = ref_policy_loss(
        policy64,
        b["old"] if old else None,
        b["adv"],
        b["weights"],
        b["lengths"],
        aggregation=aggregation,
        normalizer=float(normalizer),
        clip_low=0.2,
        clip_high=0.28,
        ref_logprobs=b["ref"],
        kl_coef=kl_coef,
    )
    want.backward()
    torch.testing.assert_close(loss.double(), want.detach(), atol=1e-6, rtol=1e-6)  # fp32 vs fp64
    torch.testing.assert_close(grad.double(), policy64.grad, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_kl_estimators_match_reference(estimator):
    b = _batch()
    normalizer = compute_normalizer(b["mask"], "seq-mean-token-mean")
    loss, metrics, grad = _call("grpo", b, normalizer, "seq-mean-token-mean", kl_coef=0.5, estimator=estimator)
    policy64 = b["policy"].clone().requires_grad_()
    common = dict(aggregation="seq-mean-token-mean", normalizer=float(normalizer), clip_low=0.2, clip_high=0.28)
    want = ref_policy_loss(
        policy64, b["old"], b["adv"], b["weights"], b["lengths"], **common, ref_logprobs=b["ref"], kl_coef=0.5,
        kl_estimator=estimator,
    )  # fmt: skip
    want.backward()
    torch.testing.assert_close(loss.double(), want.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad.double(), policy64.grad, atol=1e-6, rtol=1e-6)
    x = (b["ref"] - b["policy"])[b["mask"]]  # log pi_ref - log pi on response tokens
    expected_kl = {"k1": -x, "k2": x * x / 2, "k3": torch.exp(x) - x - 1}[estimator].sum()
    torch.testing.assert_close(metrics["kl_sum"].double(), expected_kl, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_every_loss_with_its_aggregation(name):
    aggregation = {"dapo": "token-mean", "dr_grpo": "seq-mean-token-sum"}.get(name, "seq-mean-token-mean")
    b = _batch()
    loss, metrics, grad = _call(name, b, compute_normalizer(b["mask"], aggregation), aggregation)
    assert loss.shape == () and torch.isfinite(loss) and torch.isfinite(grad).all()
    assert all(v.shape == () and not v.requires_grad for v in metrics.values())


@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum"])
def test_one_micro_batch_equals_four_and_extra_padding(aggregation):
    b = _batch()
    normalizer = compute_normalizer(b["mask"], aggregation)
    split = sum(compute_normalizer(b["mask"][i : i + 2], aggregation) for i in range(0, B, 2))
    assert torch.equal(split, normalizer)
    whole, whole_metrics, whole_grad = _call("grpo", b, normalizer, aggregation, kl_coef=0.1)
    parts = [_call("grpo", b, normalizer, aggregation, rows=slice(i, i + 2), kl_coef=0.1) for i in range(0, B, 2)]
    torch.testing.assert_close(sum(p[0] for p in parts), whole, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(torch.cat([p[2] for p in parts]), whole_grad, atol=1e-7, rtol=0)
    for key, value in whole_metrics.items():
        torch.testing.assert_close(sum(p[1][key] for p in parts), value, atol=1e-5, rtol=1e-6)
    padded = _batch(extra_pad=3)
    pad_loss, _, pad_grad = _call(
        "grpo", padded, compute_normalizer(padded["mask"], aggregation), aggregation, kl_coef=0.1
    )
    torch.testing.assert_close(pad_loss, whole, atol=0, rtol=1e-6)
    torch.testing.assert_close(pad_grad[:, :T], whole_grad, atol=0, rtol=1e-6)
    assert torch.equal(pad_grad[:, T:], torch.zeros(B, 3))


def test_metrics_literal():
    mask = torch.tensor([[True, True, True], [True, True, False], [False, False, False]])
    weights = torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    policy = torch.zeros(3, 3, requires_grad=True)
    old = torch.tensor([[0.0, -1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # ratio e at (0,1): clipped for A>0
    _, m = policy_loss(
        policy_logprobs=policy,
        old_logprobs=old,
        advantages=torch.tensor([1.0, -1.0, 0.0]),
        token_weights=weights,
        response_mask=mask,
        normalizer=torch.tensor(2.0),
        spec=LossSpec(loss_name="gtpo", aggregation="seq-mean-token-mean", clip_eps_low=0.2, clip_eps_high=0.2),
        entropy=torch.full((3, 3), 0.5),
        keep_mask=torch.tensor([True, False, True]),
    )
    expected = {
        "num_tokens": 5,
        "num_sequences": 2,
        "clipped_tokens": 1,
        "positive_tokens": 3,
        "negative_tokens": 2,
        "amplified_tokens": 1,
        "zero_weight_tokens": 3,
        "zero_weight_sequences": 1,
        "kl_sum": 0,
        "entropy_sum": 2.5,
        "filtered_sequences": 1,
        "negative_conflict_tokens": 1,
    }
    assert {k: m[k].item() for k in expected} == pytest.approx(expected)
    assert m["ratio_sum"].item() == pytest.approx(4 + torch.e)


def test_loss_spec_refuses_what_a_loss_is_not_defined_with():
    b = _batch()
    with pytest.raises(ValueError, match="dr_grpo"):
        _spec("ppo", "token-mean")
    with pytest.raises(ValueError, match="dapo uses aggregation='token-mean'"):
        _spec("dapo", "seq-mean-token-mean")
    with pytest.raises(ValueError, match="dr_grpo uses aggregation='seq-mean-token-sum'"):
        _spec("dr_grpo", "token-mean")
    for name in ("gtpo", "dapo"):
        with pytest.raises(ValueError, match=f"{name} has no KL term"):
            _spec(name, "token-mean", kl_coef=0.1)
    with pytest.raises(ValueError, match="aggregation"):
        _spec("grpo", "sum")
    with pytest.raises(ValueError, match="kl_estimator"):
        _spec("grpo", "token-mean", kl_coef=0.1, kl_estimator="k4")
    with pytest.raises(ValueError, match="must both be >= 0"):
        LossSpec(loss_name="grpo", aggregation="token-mean", clip_eps_low=-0.1, clip_eps_high=0.2)
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        policy_loss(
            policy_logprobs=b["policy"], old_logprobs=None, advantages=b["adv"], token_weights=b["weights"],
            response_mask=b["mask"], normalizer=torch.tensor(1.0), spec=_spec("grpo", "token-mean", kl_coef=0.1),
        )  # fmt: skip
    with pytest.raises(ValueError, match="max_response_length"):
        compute_normalizer(b["mask"], "token-mean", max_response_length=4)
    assert compute_normalizer(b["mask"], "seq-mean-token-sum", max_response_length=6).item() == 7 * 6


@pytest.mark.parametrize("name,aggregation,kl_coef", CASES)
def test_removed_rows_are_as_if_deleted(name, aggregation, kl_coef):
    # Rows removed from the objective (skip_uniform_groups, overlong_filter) arrive with an all-False mask
    # (TrainBatch.loss_mask): loss, gradient and normaliser equal those of the batch without them, KL included.
    b = _batch()
    removed = torch.tensor([True, False, False, False, True, False, False, True])
    masked = dict(b, mask=b["mask"] & ~removed.unsqueeze(-1))
    kept = {k: v[~removed] if torch.is_tensor(v) else v for k, v in b.items()}
    max_len = 6 if aggregation == "seq-mean-token-sum" else None
    normalizer = compute_normalizer(masked["mask"], aggregation, max_response_length=max_len)
    assert torch.equal(normalizer, compute_normalizer(kept["mask"], aggregation, max_response_length=max_len))
    loss, _, grad = _call(name, masked, normalizer, aggregation, kl_coef=kl_coef)
    want, _, want_grad = _call(name, kept, normalizer, aggregation, kl_coef=kl_coef)
    torch.testing.assert_close(loss, want, atol=1e-7, rtol=1e-6)
    torch.testing.assert_close(grad[~removed], want_grad, atol=1e-8, rtol=0)
    assert torch.equal(grad[removed], torch.zeros_like(grad[removed]))
