"""``ops.policy_objective``: delta_i and A_i - gamma <H>_i decided from each completion's own tokens, vs float64."""

from __future__ import annotations

import math

import pytest
import torch

from gtpo_megatron.batch import TrainBatch
from gtpo_megatron.ops import LossSpec, compute_normalizer, policy_objective, sequence_mean_entropy
from tests.helpers.references import ref_keep, ref_policy_loss

B, T = 6, 5
LENGTHS = [5, 2, 4, 0, 3, 5]  # row 3: no response token


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]
    logprobs = (-torch.rand(B, T, generator=gen) * 3).double()
    entropy = torch.rand(B, T, generator=gen).double() * 1.4  # per-row means on both sides of ln 2
    weights = torch.tensor([0.0, 1.0, 2.0])[torch.randint(0, 3, (B, T), generator=gen)].double() * mask
    raw = torch.randn(B, generator=gen).double()
    return logprobs, entropy, weights, raw, mask


def _spec(**fields) -> LossSpec:
    base = dict(loss_name="gtpo", aggregation="seq-mean-token-mean", clip_eps_low=0.2, clip_eps_high=0.2)
    return LossSpec(**{**base, "entropy_filter": "paper", "initial_entropy": 0.5, "entropy_penalty": 0.1, **fields})


def _objective(logprobs, entropy, weights, raw, mask, spec, **fields):
    leaf = logprobs.float().clone().requires_grad_(True)
    batch = TrainBatch(
        input_ids=torch.zeros(mask.shape, dtype=torch.long),
        response_mask=mask,
        advantages=raw.float(),
        token_weights=weights.float(),
        **fields,
    )
    normalizer = compute_normalizer(batch.loss_mask, spec.aggregation)
    loss, metrics, terms = policy_objective(leaf, entropy.float(), batch, spec, normalizer)
    loss.backward()
    return loss, metrics, terms, leaf.grad


@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "token-mean"])
def test_matches_float64_filter_penalty_and_loss(aggregation):
    logprobs, entropy, weights, raw, mask = _inputs()
    spec = _spec(aggregation=aggregation)
    loss, metrics, terms, grad = _objective(logprobs, entropy, weights, raw, mask, spec)
    seq_h = [float(entropy[i, :n].mean()) if n else 0.0 for i, n in enumerate(LENGTHS)]
    keep = ref_keep(seq_h, mode="paper", initial_entropy=0.5)
    assert terms.keep_mask.tolist() == keep and not all(keep)  # the example filters some completions
    penalised = [float(raw[i]) - 0.1 * seq_h[i] for i in range(B)]
    torch.testing.assert_close(terms.advantages.double(), torch.tensor(penalised, dtype=torch.float64))
    policy64 = logprobs.clone().requires_grad_(True)
    kept_weights = weights * torch.tensor(keep, dtype=torch.float64)[:, None]
    # docs/algorithm.md section 1: the normaliser counts every completion, filtered ones included.
    normalizer = float(compute_normalizer(mask, aggregation))
    want = ref_policy_loss(
        policy64, None, torch.tensor(penalised), kept_weights, LENGTHS, aggregation=aggregation,
        normalizer=normalizer, clip_low=0.2, clip_high=0.2,
    )  # fmt: skip
    want.backward()
    torch.testing.assert_close(loss.double(), want.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad.double(), policy64.grad, atol=1e-6, rtol=1e-6)
    with_tokens = [i for i, n in enumerate(LENGTHS) if n]
    assert metrics["seq_entropy_sum"].item() == pytest.approx(sum(seq_h[i] for i in with_tokens), rel=1e-6)
    assert metrics["advantage_abs_sum"].item() == pytest.approx(sum(abs(penalised[i]) for i in with_tokens), rel=1e-6)
    assert metrics["filtered_sequences"].item() == sum(not keep[i] for i in with_tokens)
    assert metrics["entropy_sum"].item() == pytest.approx(float(entropy[mask].sum()), rel=1e-6)


def test_given_seq_entropy_and_removed_rows():
    logprobs, entropy, weights, raw, mask = _inputs(seed=1)
    spec = _spec()
    measured = _objective(logprobs, entropy, weights, raw, mask, spec)
    given = sequence_mean_entropy(entropy.float(), mask)
    again = _objective(logprobs, torch.zeros_like(entropy), weights, raw, mask, spec, seq_entropy=given)
    assert torch.equal(measured[0], again[0]) and torch.equal(measured[3], again[3])  # the pass-before path
    # loss_row_mask False (e.g. skip_uniform_groups): the row leaves loss, normaliser and metrics, as if deleted
    row_mask = torch.tensor([False, True, True, True, True, True])
    loss, metrics, _, grad = _objective(logprobs, entropy, weights, raw, mask, spec, loss_row_mask=row_mask)
    kept = _objective(logprobs[1:], entropy[1:], weights[1:], raw[1:], mask[1:], spec)
    torch.testing.assert_close(loss, kept[0], atol=1e-7, rtol=1e-6)
    assert bool((grad[0] == 0).all()) and torch.equal(grad[1:], kept[3])
    assert {k: v.item() for k, v in metrics.items() if k != "loss"} == {
        k: v.item() for k, v in kept[1].items() if k != "loss"
    }


def test_mismatch_and_logprob_diff_sums_literal():
    mask = torch.tensor([[False, True, True, False]])
    logprobs = torch.tensor([[5.0, -1.0, -2.0, 9.0]])
    rollout = torch.tensor([[0.0, -1.5, -2.0, 0.0]])
    spec = LossSpec(loss_name="grpo", aggregation="token-mean", clip_eps_low=0.2, clip_eps_high=0.2)
    _, metrics, _, _ = _objective(
        logprobs, torch.zeros(1, 4), mask.float(), torch.tensor([1.0]), mask, spec, rollout_logprobs=rollout,
        old_logprobs=torch.tensor([[0.0, -1.25, -2.0, 0.0]]),
    )  # fmt: skip
    # The mismatch is pi_old's (the proximal policy, docs/algorithm.md section 11): |-1.25 + 1.5| on the response only
    assert metrics["mismatch_abs_logprob_diff"].item() == pytest.approx(0.25)
    assert metrics["mismatch_prob_ratio_err"].item() == pytest.approx(math.exp(0.25) - 1)
    assert metrics["logprob_diff_max"].item() == pytest.approx(0.25)


def test_filter_and_penalty_off_is_the_plain_loss():
    logprobs, entropy, weights, raw, mask = _inputs(seed=2)
    spec = LossSpec(loss_name="grpo", aggregation="seq-mean-token-mean", clip_eps_low=0.2, clip_eps_high=0.2)
    _, metrics, terms, _ = _objective(logprobs, entropy, weights, raw, mask, spec)
    assert terms.keep_mask.all() and torch.equal(terms.advantages, raw.float())
    assert metrics["filtered_sequences"].item() == 0.0


def test_paper_filter_needs_initial_entropy():
    logprobs, entropy, weights, raw, mask = _inputs()
    with pytest.raises(ValueError, match="needs initial_entropy"):
        _objective(logprobs, entropy, weights, raw, mask, _spec(initial_entropy=None))
    # <H>_ini above ln 2: the paper filter keeps every completion
    _, _, terms, _ = _objective(logprobs, entropy, weights, raw, mask, _spec(initial_entropy=math.log(2) + 0.01))
    assert terms.keep_mask.all()
