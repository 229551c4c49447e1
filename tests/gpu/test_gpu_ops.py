"""The ops layer on CUDA against the CPU float64 references (``tests/helpers/references.py``).

Inputs are built on the CPU from a fixed seed, rounded to the tested dtype, then moved to the GPU; the reference
sees the same rounded values in float64, so the only difference left is the op's fp32 arithmetic on the GPU. The
logits span Qwen's padded vocabulary (152,064 columns, 128 of them padding) with a few ``-inf`` logits (masked
tokens) in every row; the log-probs are taken at T = 0.7 and the entropy at T_H = 1.0 (one read of the logits), with
and without chunking, fp32 and bf16, gradients included. ``DEVICE`` is the GPU (the CPU in a dry run, with fewer
``NUM_TOKENS``); ``tests/plan/test_gpu_checks_cpu.py`` also points it at the CPU to check these checks themselves.
"""

from __future__ import annotations

import pytest
import torch

from gtpo_megatron.ops import LossSpec, policy_loss, vocab_parallel_logprobs_entropy
from gtpo_megatron.plan.memory import logits_bytes
from tests.gpu.common import DEVICE, DRY_RUN, needs_cuda
from tests.gpu.report import record
from tests.helpers.references import ref_logprobs_entropy, ref_policy_loss

pytestmark = pytest.mark.gpu
NUM_TOKENS = 16 if DRY_RUN else 512  # rows of the log-prob check (x 152,064 columns; float64 on the CPU)
QWEN_VOCAB, QWEN_PADDED = 151_936, 152_064  # real vocabulary, Megatron's padded width (multiple of 128)
TEMPERATURE, ENTROPY_TEMPERATURE = 0.7, 1.0


def _inputs(num_tokens: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, V]`` logits (padding columns hold garbage, 1 % of the real ones are -inf, never a target) and targets."""
    gen = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(num_tokens, QWEN_PADDED, generator=gen)).to(dtype)
    targets = torch.randint(0, QWEN_VOCAB, (num_tokens,), generator=gen)
    masked = torch.rand(num_tokens, QWEN_VOCAB, generator=gen) < 0.01
    masked[torch.arange(num_tokens), targets] = False
    logits[:, :QWEN_VOCAB][masked] = float("-inf")
    return logits, targets


@pytest.mark.parametrize(
    ("dtype", "grad_rtol"),
    # fp32: the op's fp32 softmax vs float64, about 1e-6 relative, 1e-4 leaves room for cancellation in the
    # entropy gradient; bf16 gradients are rounded to bf16 (2**-8 relative)
    [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)],
    ids=["fp32", "bf16"],
)
@pytest.mark.parametrize("chunk_size", [None, 1000], ids=["unchunked", "chunk1000"])
def test_logprobs_entropy_cuda_vs_float64(dtype: torch.dtype, grad_rtol: float, chunk_size: int | None) -> None:
    logits_cpu, targets_cpu = _inputs(NUM_TOKENS, dtype)
    logits = logits_cpu.to(DEVICE, copy=True).requires_grad_(True)
    logprobs, entropy = vocab_parallel_logprobs_entropy(
        logits, targets_cpu.to(DEVICE), vocab_size=QWEN_VOCAB, temperature=TEMPERATURE,
        entropy_temperature=ENTROPY_TEMPERATURE, chunk_size=chunk_size, entropy_requires_grad=True,
        padded_vocab_size=QWEN_PADDED,
    )  # fmt: skip
    weights = torch.randn(2, NUM_TOKENS, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (logprobs * weights[0].to(DEVICE)).sum().add((entropy * weights[1].to(DEVICE)).sum()).backward()

    ref_logits = logits_cpu.double().requires_grad_(True)
    ref_lp, _ = ref_logprobs_entropy(ref_logits, targets_cpu, vocab_size=QWEN_VOCAB, temperature=TEMPERATURE)
    _, ref_h = ref_logprobs_entropy(ref_logits, targets_cpu, vocab_size=QWEN_VOCAB, temperature=ENTROPY_TEMPERATURE)
    (ref_lp * weights[0]).sum().add((ref_h * weights[1]).sum()).backward()

    name = f"{dtype}".replace("torch.", "") + f", chunk {chunk_size}"
    lp_err = (logprobs.double().cpu() - ref_lp.detach()).abs().max().item()
    h_err = (entropy.double().cpu() - ref_h.detach()).abs().max().item()
    record("test_logprobs_entropy_cuda_vs_float64", f"max |d logprobs| {name}", lp_err, limit=2e-5, unit="nats")
    record("test_logprobs_entropy_cuda_vs_float64", f"max |d entropy| {name}", h_err, limit=2e-5, unit="nats")
    # fp32 sums over 152k columns: about 1e-6 relative, entropies of order 10 nats -> 2e-5 absolute
    assert lp_err <= 2e-5 and h_err <= 2e-5
    assert logits.grad.dtype == dtype and bool(torch.isfinite(logits.grad).all())
    grad_err = (logits.grad.double().cpu() - ref_logits.grad).abs().max().item()
    record("test_logprobs_entropy_cuda_vs_float64", f"max |d grad| {name}", grad_err)
    torch.testing.assert_close(logits.grad.double().cpu(), ref_logits.grad, rtol=grad_rtol, atol=1e-6)
    assert torch.equal(logits.grad[:, QWEN_VOCAB:].cpu(), torch.zeros_like(logits_cpu[:, QWEN_VOCAB:]))
    assert torch.equal(logits.detach().cpu(), logits_cpu)  # input not modified


def _peak_extra_bytes(logits: torch.Tensor, targets: torch.Tensor, chunk_size: int | None) -> int:
    """Peak CUDA bytes above the resident logits during one forward + backward of the op."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    leaf = logits.detach().requires_grad_(True)
    logprobs, entropy = vocab_parallel_logprobs_entropy(leaf, targets, vocab_size=QWEN_VOCAB, chunk_size=chunk_size)
    logprobs.sum().backward()
    torch.cuda.synchronize()
    del logprobs, entropy, leaf
    return torch.cuda.max_memory_allocated() - base


def test_chunking_bounds_memory_and_planner_estimate() -> None:
    """The op's peak CUDA memory above the resident logits, chunked vs unchunked, against gtpo-plan's estimate of
    the log-prob working set (``plan.memory.logits_bytes``, the number the plan's table reports)."""
    needs_cuda("peak CUDA memory")
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (3 * torch.randn(8192, QWEN_PADDED, device="cuda", generator=gen)).to(torch.bfloat16)
    targets = torch.randint(0, QWEN_VOCAB, (8192,), device="cuda", generator=gen)
    unchunked = _peak_extra_bytes(logits, targets, None)
    chunked = _peak_extra_bytes(logits, targets, 1024)
    planned = logits_bytes(QWEN_PADDED, tokens=8192, param_bytes=2, chunk_size=1024)
    planned_unchunked = logits_bytes(QWEN_PADDED, tokens=8192, param_bytes=2, chunk_size=None)
    gib = 2**30
    check = "test_chunking_bounds_memory_and_planner_estimate"
    record(check, "peak extra, unchunked (measured)", unchunked / gib, limit=planned_unchunked / gib, unit="GiB")
    record(check, "peak extra, chunk 1024 (measured)", chunked / gib, limit=planned / gib, unit="GiB")
    record(check, "chunked / unchunked", chunked / unchunked, limit=0.5)
    assert chunked <= 0.5 * unchunked
    # gtpo-plan's number also counts the resident logits, so it must bound what the op adds on top of them
    assert chunked <= planned and unchunked <= planned_unchunked
    del logits, targets
    torch.cuda.empty_cache()  # hand the 15 GiB back before vLLM checks the free memory


LOSS_CASES = {
    "gtpo": dict(aggregation="seq-mean-token-mean", clip=(0.2, 0.2), kl=0.0),
    "grpo": dict(aggregation="seq-mean-token-mean", clip=(0.2, 0.2), kl=0.04),
    "dapo": dict(aggregation="token-mean", clip=(0.2, 0.28), kl=0.0),
    "dr_grpo": dict(aggregation="seq-mean-token-sum", clip=(0.2, 0.2), kl=0.0),
}


@pytest.mark.parametrize("name", sorted(LOSS_CASES))
def test_policy_loss_cuda_vs_float64(name: str) -> None:
    case = LOSS_CASES[name]
    gen = torch.Generator().manual_seed(3)
    lengths = [7, 1, 12, 0, 5, 12]  # a zero-length row and full-length rows
    rows, width = len(lengths), 12
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    policy = -torch.rand(rows, width, generator=gen, dtype=torch.float64) * 3
    old = policy + 0.3 * torch.randn(rows, width, generator=gen, dtype=torch.float64)  # ratios outside the clip
    ref = policy + 0.1 * torch.randn(rows, width, generator=gen, dtype=torch.float64)
    advantages = torch.randn(rows, generator=gen, dtype=torch.float64)
    weights = torch.where(mask, torch.rand(rows, width, generator=gen, dtype=torch.float64) * 2, 0.0)
    normalizer = float(mask.sum()) if case["aggregation"] == "token-mean" else float(mask.any(-1).sum())

    cuda_policy = policy.float().to(DEVICE).requires_grad_(True)
    spec = LossSpec(
        loss_name=name, aggregation=case["aggregation"], clip_eps_low=case["clip"][0], clip_eps_high=case["clip"][1],
        kl_coef=case["kl"],
    )  # fmt: skip
    loss, _ = policy_loss(
        policy_logprobs=cuda_policy, old_logprobs=old.float().to(DEVICE), advantages=advantages.float().to(DEVICE),
        token_weights=weights.float().to(DEVICE), response_mask=mask.to(DEVICE),
        normalizer=torch.tensor(normalizer, device=DEVICE), spec=spec, ref_logprobs=ref.float().to(DEVICE),
    )  # fmt: skip
    loss.backward()
    ref_policy = policy.float().double().requires_grad_(True)  # the same fp32-rounded inputs, in float64
    expected = ref_policy_loss(
        ref_policy, old.float().double(), advantages.float().double(), weights.float().double(), lengths,
        aggregation=case["aggregation"], normalizer=normalizer, clip_low=case["clip"][0], clip_high=case["clip"][1],
        ref_logprobs=ref.float().double(), kl_coef=case["kl"],
    )  # fmt: skip
    expected.backward()
    loss_err = abs(loss.item() - expected.item())
    grad_err = (cuda_policy.grad.double().cpu() - ref_policy.grad).abs().max().item()
    record("test_policy_loss_cuda_vs_float64", f"{name}: |d loss|, max |d grad|", max(loss_err, grad_err), limit=1e-5)
    assert loss_err <= 1e-5 and grad_err <= 1e-5  # fp32 on GPU vs float64 on CPU, O(1) values
