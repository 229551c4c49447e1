"""The loss closure bound by ``forward_step`` and its normalisation contract, in one process with fake logits.

The Megatron path is replayed by hand exactly as ``forward_step``'s docstring derives it: each micro-batch's
returned loss is divided by M (schedule) and the gradients of the D data-parallel ranks are averaged (DDP).
Whatever the split, the logits' gradient must equal that of the whole batch as a single micro-batch, and both must
equal a float64 hand-written GTPO objective (docs/algorithm.md section 1, seq-mean-token-mean).
"""

from __future__ import annotations

import pytest
import torch

from gtpo_megatron.megatron_adapter.forward_step import (
    ForwardSettings,
    MicroBatch,
    policy_loss_closure,
    token_logprobs_entropy,
)
from gtpo_megatron.ops import LossSpec, compute_normalizer
from tests.helpers.references import ref_logprobs_entropy

ROWS, SEQ, VOCAB, PADDED = 8, 7, 11, 16


def _inputs():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(ROWS, SEQ, PADDED, generator=gen, dtype=torch.float64).float()
    input_ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=gen)
    lengths = torch.tensor([7, 5, 3, 6, 7, 4, 2, 7])  # row 6: prompt only (no response token)
    columns = torch.arange(SEQ)
    response_mask = (columns[None] < lengths[:, None]) & (columns[None] >= 2)
    weights = torch.rand(ROWS, SEQ, generator=gen) * 2 * response_mask
    return logits, MicroBatch(
        input_ids=input_ids,
        position_ids=columns.expand(ROWS, -1),
        attention_mask=None,
        response_mask=response_mask,
        token_weights=weights,
        advantages=torch.randn(ROWS, generator=gen),
    )


def _settings(**fields) -> ForwardSettings:
    return ForwardSettings(tp_group=None, vocab_size=VOCAB, temperature=1.0, chunk_size=None, **fields)


def _rows(batch: MicroBatch, rows: slice) -> MicroBatch:
    return MicroBatch(**{k: (v[rows] if isinstance(v, torch.Tensor) else v) for k, v in vars(batch).items()})


def test_column_convention_matches_reference():
    logits, batch = _inputs()
    logprobs, entropy = token_logprobs_entropy(logits, batch, _settings())
    ref_lp, ref_ent = ref_logprobs_entropy(logits[:, :-1, :VOCAB], batch.input_ids[:, 1:])
    mask = batch.response_mask[:, 1:]
    assert torch.allclose(logprobs[:, 1:][mask].double(), ref_lp[mask], atol=1e-6, rtol=0)
    assert torch.allclose(entropy[:, 1:][mask].double(), ref_ent[mask], atol=1e-6, rtol=0)
    assert bool((logprobs[~batch.response_mask] == 0).all()) and bool((logprobs[:, 0] == 0).all())


def _replay_megatron(logits, batch, *, dp: int, micro_batches: int) -> torch.Tensor:
    """Gradient w.r.t. the logits after Megatron's schedule (1/M) and DDP averaging (1/D), by hand."""
    normalizer = compute_normalizer(batch.response_mask, "seq-mean-token-mean")
    loss = LossSpec(loss_name="gtpo", aggregation="seq-mean-token-mean", clip_eps_low=0.2, clip_eps_high=0.2)
    settings = _settings(loss=loss, normalizer=normalizer, loss_scale=float(micro_batches * dp))
    leaf = logits.clone().requires_grad_(True)
    per_rank, per_micro = ROWS // dp, ROWS // dp // micro_batches
    for d in range(dp):
        rank_grad = torch.zeros_like(leaf)
        for m in range(micro_batches):
            rows = slice(d * per_rank + m * per_micro, d * per_rank + (m + 1) * per_micro)
            loss, metrics = policy_loss_closure(leaf[rows], _rows(batch, rows), settings)
            assert metrics["loss"].item() == pytest.approx(loss.item() / (micro_batches * dp))
            (grad,) = torch.autograd.grad(loss / micro_batches, leaf)  # the schedule's division by M
            rank_grad += grad
        leaf.grad = rank_grad / dp if leaf.grad is None else leaf.grad + rank_grad / dp  # DDP average
    return leaf.grad


def _reference_gradient(logits, batch) -> torch.Tensor:
    """float64 GTPO objective, one update per batch (ratio 1 with gradient), seq-mean-token-mean."""
    leaf = logits.double().clone().requires_grad_(True)
    logp = torch.log_softmax(leaf[:, :-1, :VOCAB], dim=-1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    mask, weights = batch.response_mask[:, 1:], batch.token_weights[:, 1:].double()
    lengths = mask.sum(-1)
    has_tokens = lengths > 0
    per_seq = (torch.exp(logp - logp.detach()) * weights * mask).sum(-1) * batch.advantages.double()
    loss = -(per_seq[has_tokens] / lengths[has_tokens]).sum() / has_tokens.sum()
    loss.backward()
    return leaf.grad.float()


@pytest.mark.parametrize("dp,micro_batches", [(1, 1), (1, 4), (2, 1), (2, 2), (4, 2)])
def test_gradient_is_independent_of_the_split(dp, micro_batches):
    logits, batch = _inputs()
    expected = _reference_gradient(logits, batch)
    got = _replay_megatron(logits, batch, dp=dp, micro_batches=micro_batches)
    assert torch.allclose(got, expected, atol=1e-7, rtol=0), (got - expected).abs().max()


def test_forward_only_mode_and_drift_metric():
    logits, batch = _inputs()
    loss, values = policy_loss_closure(logits, batch, _settings())
    assert loss.item() == 0.0 and set(values) == {"logprobs", "entropy"}
    batch.old_logprobs = values["logprobs"].clone()
    batch.old_logprobs[0, 3] += 0.25
    normalizer = compute_normalizer(batch.response_mask, "token-mean")
    loss = LossSpec(loss_name="gtpo", aggregation="token-mean", clip_eps_low=0.2, clip_eps_high=0.2)
    _, metrics = policy_loss_closure(logits, batch, _settings(loss=loss, normalizer=normalizer))
    assert metrics["logprob_diff_max"].item() == pytest.approx(0.25, abs=1e-6)
    assert metrics["num_tokens"].item() == normalizer.item()
