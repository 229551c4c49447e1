"""``vocab_parallel_logprobs_entropy`` with non-finite logits, in one process.

A ``-inf`` logit is a masked token of probability 0; a row whose real vocabulary is all ``-inf``, or holds
``+inf``/NaN, is refused; padded columns (``>= vocab_size``) may hold anything. The TP=2 cases (one shard all
``-inf``) are in ``tests/distributed/test_ops_tensor_parallel.py``.
"""

from __future__ import annotations

import pytest
import torch

from gtpo_megatron.ops import vocab_parallel_logprobs_entropy
from tests.helpers.references import ref_logprobs_entropy

INF = float("inf")


def test_literal_masked_token():
    # p = [1, e, 0] / (1 + e): logprob(0) = -ln(1 + e) = -1.313261688; entropy = 0.582203109 nats.
    # d logprob / dz = 1[k=0] - p = [0.731058579, -0.731058579, 0]; d H / dz = -p (ln p + H) = [0.196611933,
    # -0.196611933, 0]: the masked column gets exactly 0 from both.
    logits = torch.tensor([[0.0, 1.0, -INF]], requires_grad=True)
    logprobs, entropy = vocab_parallel_logprobs_entropy(logits, torch.tensor([0]), entropy_requires_grad=True)
    assert logprobs.item() == pytest.approx(-1.313261688, abs=1e-6)
    assert entropy.item() == pytest.approx(0.582203109, abs=1e-6)
    (grad_lp,) = torch.autograd.grad(logprobs.sum(), logits, retain_graph=True)
    (grad_h,) = torch.autograd.grad(entropy.sum(), logits)
    torch.testing.assert_close(grad_lp, torch.tensor([[0.731058579, -0.731058579, 0.0]]), atol=1e-6, rtol=0)
    torch.testing.assert_close(grad_h, torch.tensor([[0.196611933, -0.196611933, 0.0]]), atol=1e-6, rtol=0)
    assert grad_lp[0, 2] == 0 and grad_h[0, 2] == 0


def test_literal_masked_token_at_temperature_half():
    # z / 0.5 = [0, 2, -inf]: logprob(0) = -ln(1 + e^2) = -2.126928011; entropy = 0.365333855 nats.
    logits = torch.tensor([[0.0, 1.0, -INF]])
    for chunk_size in (None, 1):
        logprobs, entropy = vocab_parallel_logprobs_entropy(
            logits, torch.tensor([0]), temperature=0.5, chunk_size=chunk_size
        )
        assert logprobs.item() == pytest.approx(-2.126928011, abs=1e-6)
        assert entropy.item() == pytest.approx(0.365333855, abs=1e-6)


def test_masked_target_has_minus_inf_logprob_and_finite_gradient():
    # log p of a probability-0 token is -inf (its exact value); d logprob / dz = 1[k=2] - p = [-0.268941421,
    # -0.731058579, 1].
    logits = torch.tensor([[0.0, 1.0, -INF]], requires_grad=True)
    logprobs, entropy = vocab_parallel_logprobs_entropy(logits, torch.tensor([2]))
    assert logprobs.item() == -INF and entropy.item() == pytest.approx(0.582203109, abs=1e-6)
    logprobs.sum().backward()
    torch.testing.assert_close(logits.grad, torch.tensor([[-0.268941421, -0.731058579, 1.0]]), atol=1e-6, rtol=0)


def _masked_logits(dtype=torch.float32) -> torch.Tensor:
    """``[4, 7, 33]`` logits, vocab 30: a quarter of the real columns -inf (one row all but one column), and
    non-finite garbage in the padded columns 30-32."""
    gen = torch.Generator().manual_seed(3)
    logits = 3 * torch.randn(4, 7, 33, generator=gen)
    logits[torch.rand(4, 7, 33, generator=gen) < 0.25] = -INF
    logits[1, 2, :29] = -INF
    logits[1, 2, 29] = 0.5
    logits[..., 30], logits[..., 31], logits[..., 32] = -INF, INF, float("nan")
    return logits.to(dtype)


def _finite_targets(logits: torch.Tensor) -> torch.Tensor:
    """A target per row whose own logit is finite (the argmax of the real columns)."""
    return logits[..., :30].float().argmax(dim=-1)


@pytest.mark.parametrize("entropy_temperature", [None, 1.3])
@pytest.mark.parametrize("temperature", [1.0, 0.5])
@pytest.mark.parametrize("chunk_size", [None, 3])
def test_masked_logits_match_float64_reference(chunk_size, temperature, entropy_temperature):
    full = _masked_logits()
    targets = _finite_targets(full)
    logits = full.clone().requires_grad_()
    logprobs, entropy = vocab_parallel_logprobs_entropy(
        logits,
        targets,
        vocab_size=30,
        temperature=temperature,
        entropy_temperature=entropy_temperature,
        chunk_size=chunk_size,
        entropy_requires_grad=True,
    )
    ref_input = full.double().requires_grad_()
    ref_lp, _ = ref_logprobs_entropy(ref_input, targets, vocab_size=30, temperature=temperature)
    _, ref_h = ref_logprobs_entropy(ref_input, targets, vocab_size=30, temperature=entropy_temperature or temperature)
    # float32 computation vs float64 reference: a few ulps of values ~O(10).
    torch.testing.assert_close(logprobs.double(), ref_lp.detach(), atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(entropy.double(), ref_h.detach(), atol=1e-5, rtol=1e-6)
    g_lp, g_h = torch.randn(4, 7), torch.randn(4, 7)
    (logprobs * g_lp + entropy * g_h).sum().backward()
    (ref_lp * g_lp.double() + ref_h * g_h.double()).sum().backward()
    assert bool(torch.isfinite(logits.grad).all())
    torch.testing.assert_close(logits.grad.double(), ref_input.grad, atol=1e-6, rtol=1e-6)
    masked = torch.isinf(full[..., :30])
    assert bool((logits.grad[..., :30][masked] == 0).all()) and bool((logits.grad[..., 30:] == 0).all())


@pytest.mark.parametrize("entropy_requires_grad", [False, True])
def test_masked_bfloat16_logits(entropy_requires_grad):
    full = _masked_logits(torch.bfloat16)
    targets = _finite_targets(full)
    logits = full.clone().requires_grad_()
    logprobs, entropy = vocab_parallel_logprobs_entropy(
        logits, targets, vocab_size=30, chunk_size=5, entropy_requires_grad=entropy_requires_grad
    )
    ref_input = full.double().requires_grad_()
    ref_lp, ref_h = ref_logprobs_entropy(ref_input, targets, vocab_size=30)
    # bf16 inputs are exact in fp32, so only fp32 arithmetic error remains.
    torch.testing.assert_close(logprobs.double(), ref_lp.detach(), atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(entropy.double(), ref_h.detach(), atol=1e-5, rtol=1e-6)
    loss, ref_loss = logprobs.sum(), ref_lp.sum()
    if entropy_requires_grad:
        loss, ref_loss = loss + 0.5 * entropy.sum(), ref_loss + 0.5 * ref_h.sum()
    loss.backward()
    ref_loss.backward()
    # the gradient is rounded to bf16 (2**-8 relative)
    torch.testing.assert_close(logits.grad.double(), ref_input.grad, atol=1e-6, rtol=1e-2)
    assert bool((logits.grad[torch.isinf(full) | torch.isnan(full)] == 0).all())


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (-INF, r"row \(1, 2\) .* is -inf in all 4 real vocabulary columns"),
        (INF, r"row \(1, 2\) .* holds \+inf or NaN"),
        (float("nan"), r"row \(1, 2\) .* holds \+inf or NaN"),
    ],
    ids=["all-minus-inf", "plus-inf", "nan"],
)
@pytest.mark.parametrize("chunk_size", [None, 2])
def test_rows_without_a_softmax_are_refused(value, message, chunk_size):
    logits = torch.randn(2, 3, 5)
    logits[1, 2, :4] = value if value == -INF else torch.tensor([0.0, value, 1.0, 2.0])
    with pytest.raises(ValueError, match=message):
        vocab_parallel_logprobs_entropy(
            logits, torch.zeros(2, 3, dtype=torch.long), vocab_size=4, chunk_size=chunk_size
        )


def test_unchecked_rows_without_a_softmax_give_nan():
    # check_inputs=False skips the host sync: the documented result of such a row is NaN, other rows unaffected.
    logits = torch.tensor([[0.0, 1.0, -INF], [-INF, -INF, -INF]])
    logprobs, entropy = vocab_parallel_logprobs_entropy(logits, torch.tensor([0, 0]), check_inputs=False)
    assert logprobs[0].item() == pytest.approx(-1.313261688, abs=1e-6)
    assert bool(torch.isnan(logprobs[1])) and bool(torch.isnan(entropy[1]))
