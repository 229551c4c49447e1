"""``vocab_parallel_logprobs_entropy`` in one process (tp_group=None) vs literal values and the float64 reference."""

from __future__ import annotations

import math

import pytest
import torch

from gtpo_megatron.ops import vocab_parallel_logprobs_entropy
from tests.helpers.references import ref_logprobs_entropy

# Weights w_j of a 10-token vocabulary; logits ln(w_j) give p_j = w_j / 30.
WEIGHTS = [1.0, 2.0, 3.0, 4.0, 5.0, 5.0, 4.0, 3.0, 2.0, 1.0]


def _literal_logits() -> torch.Tensor:
    return torch.log(torch.tensor([WEIGHTS]))  # [1, 10]


def test_literal_ten_token_vocabulary():
    # target 4 (w = 5): logprob = ln(5/30) = -ln 6 = -1.791759469.
    # entropy = ln 30 - sum w ln w / 30 = 3.401197382 - 2*(2ln2 + 3ln3 + 4ln4 + 5ln5)/30
    #         = 3.401197382 - 36.548995829/30 = 3.401197382 - 1.218299861 = 2.182897521 nats.
    logprobs, entropy = vocab_parallel_logprobs_entropy(_literal_logits(), torch.tensor([4]))
    assert logprobs.item() == pytest.approx(-1.791759469, abs=1e-6)
    assert entropy.item() == pytest.approx(2.182897521, abs=1e-6)


def test_literal_temperature_half():
    # z / 0.5 = 2 ln w, so p_j = w_j^2 / 110. target 4: ln(25/110) = -1.481604541.
    # entropy = ln 110 - sum w^2 ln(w^2) / 110 = 4.700480366 - 2*150.153513807/110 = 4.700480366 - 2.730063888
    #         = 1.970416478 nats.
    logprobs, entropy = vocab_parallel_logprobs_entropy(_literal_logits(), torch.tensor([4]), temperature=0.5)
    assert logprobs.item() == pytest.approx(-1.481604541, abs=1e-6)
    assert entropy.item() == pytest.approx(1.970416478, abs=1e-6)


def test_padded_vocabulary_columns_take_no_mass_and_no_gradient():
    # Two padded columns with huge logits must not change the literal 10-token answer.
    logits = torch.cat([_literal_logits(), torch.tensor([[50.0, 80.0]])], dim=-1).requires_grad_()
    logprobs, entropy = vocab_parallel_logprobs_entropy(
        logits, torch.tensor([4]), vocab_size=10, entropy_requires_grad=True
    )
    assert logprobs.item() == pytest.approx(-1.791759469, abs=1e-6)
    assert entropy.item() == pytest.approx(2.182897521, abs=1e-6)
    (logprobs + entropy).sum().backward()
    assert torch.equal(logits.grad[0, 10:], torch.zeros(2))
    with pytest.raises(ValueError, match="vocab_size=10"):
        vocab_parallel_logprobs_entropy(logits, torch.tensor([10]), vocab_size=10)


def test_literal_logprobs_and_entropy_at_two_temperatures():
    # One call, one read of the logits: log-probs at one temperature, entropy at the other (values above).
    logprobs, entropy = vocab_parallel_logprobs_entropy(
        _literal_logits(), torch.tensor([4]), temperature=1.0, entropy_temperature=0.5
    )
    assert logprobs.item() == pytest.approx(-1.791759469, abs=1e-6)
    assert entropy.item() == pytest.approx(1.970416478, abs=1e-6)
    logprobs, entropy = vocab_parallel_logprobs_entropy(
        _literal_logits(), torch.tensor([4]), temperature=0.5, entropy_temperature=1.0, chunk_size=1
    )
    assert logprobs.item() == pytest.approx(-1.481604541, abs=1e-6)
    assert entropy.item() == pytest.approx(2.182897521, abs=1e-6)


@pytest.mark.parametrize("entropy_requires_grad", [False, True])
@pytest.mark.parametrize(("temperature", "entropy_temperature"), [(0.9, 1.0), (1.0, 0.6), (1.7, 0.8)])
@pytest.mark.parametrize("chunk_size", [None, 3])
def test_separate_entropy_temperature_matches_float64(
    chunk_size, temperature, entropy_temperature, entropy_requires_grad
):
    logits = (3 * torch.randn(4, 7, 33)).requires_grad_()
    targets = torch.randint(0, 30, (4, 7))
    logprobs, entropy = vocab_parallel_logprobs_entropy(
        logits,
        targets,
        vocab_size=30,
        temperature=temperature,
        entropy_temperature=entropy_temperature,
        chunk_size=chunk_size,
        entropy_requires_grad=entropy_requires_grad,
    )
    assert entropy.requires_grad == entropy_requires_grad
    ref_input = logits.detach().double().requires_grad_()
    ref_lp, _ = ref_logprobs_entropy(ref_input, targets, vocab_size=30, temperature=temperature)
    _, ref_h = ref_logprobs_entropy(ref_input, targets, vocab_size=30, temperature=entropy_temperature)
    # float32 computation vs float64 reference: a few ulps of values ~O(10).
    torch.testing.assert_close(logprobs.double(), ref_lp.detach(), atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(entropy.double(), ref_h.detach(), atol=1e-5, rtol=1e-6)
    g_lp, g_h = torch.randn(4, 7), torch.randn(4, 7)
    loss, ref_loss = (logprobs * g_lp).sum(), (ref_lp * g_lp.double()).sum()
    if entropy_requires_grad:
        loss, ref_loss = loss + (entropy * g_h).sum(), ref_loss + (ref_h * g_h.double()).sum()
    loss.backward()
    ref_loss.backward()
    torch.testing.assert_close(logits.grad.double(), ref_input.grad, atol=1e-6, rtol=1e-6)
    assert torch.equal(logits.grad[..., 30:], torch.zeros(4, 7, 3))


def test_entropy_temperature_equal_to_temperature_is_the_default_path():
    logits, targets = torch.randn(3, 5, 40), torch.randint(0, 40, (3, 5))
    default = vocab_parallel_logprobs_entropy(logits, targets, temperature=0.7, chunk_size=4)
    same = vocab_parallel_logprobs_entropy(logits, targets, temperature=0.7, entropy_temperature=0.7, chunk_size=4)
    for a, b in zip(default, same):
        assert torch.equal(a, b)
    lp, none = vocab_parallel_logprobs_entropy(
        logits, targets, temperature=0.7, entropy_temperature=1.0, with_entropy=False
    )
    assert none is None and torch.equal(lp, default[0])


@pytest.mark.parametrize("temperature", [1.0, 0.5, 1.7])
@pytest.mark.parametrize("chunk_size", [None, 3, 64])
def test_matches_float64_reference_values_and_gradients(temperature, chunk_size):
    logits = (3 * torch.randn(4, 7, 33)).requires_grad_()
    targets = torch.randint(0, 30, (4, 7))
    before = logits.detach().clone()
    logprobs, entropy = vocab_parallel_logprobs_entropy(
        logits, targets, vocab_size=30, temperature=temperature, chunk_size=chunk_size, entropy_requires_grad=True
    )
    assert torch.equal(logits.detach(), before)  # never modifies its input
    ref_input = before.double().requires_grad_()
    ref_lp, ref_h = ref_logprobs_entropy(ref_input, targets, vocab_size=30, temperature=temperature)
    # float32 computation vs float64 reference: a few ulps of values ~O(10).
    torch.testing.assert_close(logprobs.double(), ref_lp.detach(), atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(entropy.double(), ref_h.detach(), atol=1e-5, rtol=1e-6)
    g_lp, g_h = torch.randn(4, 7), torch.randn(4, 7)
    (logprobs * g_lp + entropy * g_h).sum().backward()
    (ref_lp * g_lp.double() + ref_h * g_h.double()).sum().backward()
    torch.testing.assert_close(logits.grad.double(), ref_input.grad, atol=1e-6, rtol=1e-6)
    assert torch.equal(logits.grad[..., 30:], torch.zeros(4, 7, 3))


def test_chunked_equals_unchunked():
    logits = torch.randn(5, 9, 40, requires_grad=True)
    targets = torch.randint(0, 40, (5, 9))
    outs = []
    for chunk_size in (None, 4):
        logits.grad = None
        lp, h = vocab_parallel_logprobs_entropy(logits, targets, chunk_size=chunk_size, entropy_requires_grad=True)
        (lp.sum() + 0.3 * h.sum()).backward()
        outs.append((lp.detach(), h.detach(), logits.grad.clone()))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=0)  # same per-row reductions; only chunk bounds differ


def test_entropy_detached_by_default_and_logprob_gradient_only():
    logits = torch.randn(3, 6, requires_grad=True)
    targets = torch.tensor([0, 5, 2])
    lp, h = vocab_parallel_logprobs_entropy(logits, targets)
    assert lp.requires_grad and not h.requires_grad
    lp.sum().backward()
    ref_input = logits.detach().double().requires_grad_()
    ref_input.log_softmax(-1).gather(-1, targets[:, None]).sum().backward()
    torch.testing.assert_close(logits.grad.double(), ref_input.grad, atol=1e-7, rtol=0)
    _, none = vocab_parallel_logprobs_entropy(logits, targets, with_entropy=False)
    assert none is None


def test_bfloat16_logits():
    logits32 = 2 * torch.randn(6, 50)
    logits = logits32.to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 50, (6,))
    lp, h = vocab_parallel_logprobs_entropy(logits, targets, chunk_size=4)
    assert lp.dtype == torch.float32 and h.dtype == torch.float32
    ref_lp, ref_h = ref_logprobs_entropy(logits.detach().double(), targets)
    # bf16 inputs are exact in fp32, so only fp32 arithmetic error remains.
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(h.double(), ref_h, atol=1e-5, rtol=1e-6)
    lp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


def test_empty_batch_and_errors():
    lp, h = vocab_parallel_logprobs_entropy(torch.zeros(0, 8), torch.zeros(0, dtype=torch.long))
    assert lp.shape == (0,) and h.shape == (0,)
    logits = torch.randn(2, 8)
    with pytest.raises(ValueError, match="padded_vocab_size"):
        vocab_parallel_logprobs_entropy(logits, torch.tensor([0, 1]), padded_vocab_size=16)
    with pytest.raises(ValueError, match="temperature=0.0 must be > 0"):
        vocab_parallel_logprobs_entropy(logits, torch.tensor([0, 1]), temperature=0.0)
    with pytest.raises(ValueError, match="entropy_temperature=-1.0 must be > 0"):
        vocab_parallel_logprobs_entropy(logits, torch.tensor([0, 1]), entropy_temperature=-1.0)
    with pytest.raises(ValueError, match="outside"):
        vocab_parallel_logprobs_entropy(logits, torch.tensor([0, -1]))
    with pytest.raises(ValueError, match="target_ids shape"):
        vocab_parallel_logprobs_entropy(logits, torch.tensor([0]))
    assert math.isfinite(vocab_parallel_logprobs_entropy(logits, torch.tensor([0, 7]))[0].sum().item())


@pytest.mark.parametrize("chunk_size", [None, 3])
@pytest.mark.parametrize("view", [lambda x: x[:, :-1], lambda x: x.transpose(0, 1)[:5]], ids=["shift", "transpose"])
def test_non_contiguous_views(chunk_size, view):
    # Megatron-style next-token slice logits[:, :-1] of [B, S, V], and a transposed [S, B, V] -> [B, S, V] view.
    full = torch.randn(3, 6, 20, requires_grad=True)
    targets = torch.randint(0, 20, view(full).shape[:2])
    lp, h = vocab_parallel_logprobs_entropy(view(full), targets, chunk_size=chunk_size, entropy_requires_grad=True)
    (lp.sum() + 0.5 * h.sum()).backward()
    ref_full = full.detach().double().requires_grad_()
    ref_lp, ref_h = ref_logprobs_entropy(view(ref_full), targets)
    (ref_lp.sum() + 0.5 * ref_h.sum()).backward()
    torch.testing.assert_close(lp.double(), ref_lp.detach(), atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(h.double(), ref_h.detach(), atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(full.grad.double(), ref_full.grad, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy_requires_grad", [False, True])
def test_working_set_is_at_most_the_planned_fp32_buffers(monkeypatch, dtype, temperature, entropy_requires_grad):
    # gtpo-plan counts FP32_OP_BUFFERS chunk buffers for the op (plan.memory); forward and backward stay within it
    from gtpo_megatron.ops import logprobs as op_module
    from gtpo_megatron.plan.memory import FP32_OP_BUFFERS

    counts, original = [], op_module._work_buffers
    monkeypatch.setattr(op_module, "_work_buffers", lambda *a: counts.append(a[-1]) or original(*a))
    logits = (3 * torch.randn(2, 5, 40)).to(dtype).requires_grad_()
    targets = torch.randint(0, 40, (2, 5))
    ref_logits = logits.detach().double().requires_grad_()
    logprobs, entropy = vocab_parallel_logprobs_entropy(
        logits, targets, temperature=temperature, chunk_size=3, entropy_requires_grad=entropy_requires_grad
    )
    (logprobs.sum() + (entropy.sum() if entropy_requires_grad else 0)).backward()
    assert counts and max(counts) <= FP32_OP_BUFFERS
    ref_lp, ref_h = ref_logprobs_entropy(ref_logits, targets, temperature=temperature)
    (ref_lp.sum() + (ref_h.sum() if entropy_requires_grad else 0)).backward()
    torch.testing.assert_close(logits.grad.double(), ref_logits.grad.to(dtype).double(), rtol=2e-2, atol=1e-5)
