"""GPU benchmarks (``run_gpu_checks.sh --bench``): numbers for ``docs/performance.md``, one run, one table.

* The fused log-prob + entropy op against Megatron's ``vocab_parallel_cross_entropy`` (log-probs only) and the naive
  ``log_softmax``: N = 8,192 bf16 logits of Qwen's vocabulary (151,936), forward + backward; time and peak-memory
  ratios, and the fraction of the bandwidth roofline (three reads of the logits at :data:`HBM_BYTES_PER_S`).
* The training step (``MegatronPolicy.train_step``: forward, backward, optimizer) in bf16 on a random-initialised
  model of :data:`ARCH`'s dimensions (``plan.architectures``; no weights: a ``config.json`` only), at sequence
  2,048 and longer until one does not fit: tokens/s, MFU against :data:`PEAK_FLOPS`, peak memory against
  ``gtpo-plan``'s estimate (``plan.memory.estimate_stage``, which assumes flash attention; Megatron's local layer
  specs, used without Transformer Engine, also keep each layer's ``s x s`` attention probabilities).
* The GTPO step's own overhead: ``algorithm.compute_weights`` (advantages, conflicts; CPU, as the trainer runs it)
  and ``ops.policy_objective`` forward + backward (GPU), as fractions of the training step on the same batch (run
  before the sequence sweep, whose last step may run out of memory).

Model FLOPs and the shared helpers: ``tests/gpu/bench_common.py``. A dry run uses tiny sizes on the CPU (no CUDA
memory numbers).
"""

from __future__ import annotations

import dataclasses
import functools
import gc

import pytest
import torch

from gtpo_megatron.ops import vocab_parallel_logprobs_entropy
from gtpo_megatron.plan.architectures import KNOWN_ARCHITECTURES
from tests.gpu.bench_common import (
    CHUNK,
    GIB,
    HBM_BYTES_PER_S,
    PEAK_FLOPS,
    flops_per_token,
    median_seconds,
    peak_extra_bytes,
    plan_bytes,
    random_batch,
    random_policy,
)
from tests.gpu.common import DEVICE, DRY_RUN
from tests.gpu.report import bench_row, record

pytestmark = pytest.mark.gpu
ARCH = KNOWN_ARCHITECTURES["Qwen2.5-1.5B-Instruct"]
if DRY_RUN:
    ARCH = dataclasses.replace(ARCH, num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                               num_query_groups=2, head_dim=16, vocab_size=1024)  # fmt: skip
SEQ_LENGTHS = (32, 64) if DRY_RUN else (2048, 4096, 8192, 12288, 16384, 24576, 32768)
TOKENS_PER_STEP = 128 if DRY_RUN else 16384
OP_TOKENS, OP_VOCAB = (64, 4096) if DRY_RUN else (8192, 151_936)
OVERHEAD_ROWS, GROUP_SIZE = (4, 2) if DRY_RUN else (16, 8)
REPEATS = 1 if DRY_RUN else 5


def test_bench_logprob_op(groups) -> None:
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(OP_TOKENS, OP_VOCAB, generator=gen)).to(torch.bfloat16).to(DEVICE)
    targets = torch.randint(0, OP_VOCAB, (OP_TOKENS,), generator=gen).to(DEVICE)
    weights = torch.randn(OP_TOKENS, generator=gen).to(DEVICE)
    logprobs = {}

    def fused(chunk):
        def run():
            leaf = logits.detach().requires_grad_()
            lp, _ = vocab_parallel_logprobs_entropy(leaf, targets, chunk_size=chunk)
            (lp * weights).sum().backward()
            logprobs[f"fused chunk {chunk}"] = lp.detach()

        return run

    def megatron():
        leaf = logits.detach().requires_grad_()
        loss = vocab_parallel_cross_entropy(leaf.unsqueeze(1), targets.unsqueeze(1)).squeeze(1)  # -log p
        (-loss * weights).sum().backward()
        logprobs["megatron"] = -loss.detach()

    def naive():
        leaf = logits.detach().requires_grad_()
        logp = torch.log_softmax(leaf.float(), dim=-1)
        lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        with torch.no_grad():
            (logp.exp() * logp).sum(-1)
        (lp * weights).sum().backward()

    variants = {"fused chunk 1024": fused(CHUNK), "fused unchunked": fused(None), "megatron": megatron, "naive": naive}
    seconds = {name: _median_seconds(fn) for name, fn in variants.items()}
    peaks = {name: peak_extra_bytes(fn) for name, fn in variants.items()}
    roofline_s = 3 * logits.numel() * logits.element_size() / HBM_BYTES_PER_S
    table = f"log-prob op, N={OP_TOKENS}, V={OP_VOCAB}, bf16 logits, fwd+bwd (roofline: 3 reads at 4.8 TB/s)"
    for name in variants:
        t, m = seconds[name], peaks[name]
        bench_row(table, variant=name, ms=t * 1e3, **{
            "t/megatron": t / seconds["megatron"], "t/naive": t / seconds["naive"], "peak extra GiB": m / GIB,
            "mem/megatron": m / peaks["megatron"], "mem/naive": m / peaks["naive"], "roofline": roofline_s / t,
        })  # fmt: skip
    check = "test_bench_logprob_op"
    error = (logprobs[f"fused chunk {CHUNK}"] - logprobs["megatron"]).abs().max().item()
    record(check, "max |fused - megatron| log-prob", error, limit=1e-3, unit="nats")
    assert error <= 1e-3


_median_seconds = functools.partial(median_seconds, repeats=REPEATS)


@pytest.fixture(scope="module")
def policy(groups, tmp_path_factory):
    return random_policy(groups, ARCH, tmp_path_factory.mktemp("arch"))


LOSS_KW = dict(loss_name="gtpo", aggregation="seq-mean-token-mean", clip_eps_low=0.2, clip_eps_high=0.2)


def test_bench_gtpo_overhead(policy) -> None:
    from gtpo_megatron.algorithm import build_loss_spec, compute_weights
    from gtpo_megatron.config import AlgorithmConfig, RolloutConfig
    from gtpo_megatron.ops import policy_objective

    algorithm = AlgorithmConfig(group_size=GROUP_SIZE)  # the GTPO defaults: conflicts prefix_suffix, the paper's filter
    spec = dataclasses.replace(build_loss_spec(algorithm, RolloutConfig()), initial_entropy=1.0)
    seq_len = SEQ_LENGTHS[0]
    batch = random_batch(ARCH, OVERHEAD_ROWS, seq_len, group_size=GROUP_SIZE, seed=1)
    rewards = (torch.rand(OVERHEAD_ROWS, generator=torch.Generator().manual_seed(2)) < 0.5).float()

    def weights():
        return compute_weights(batch.input_ids, batch.response_mask, rewards, algorithm, loss_spec=spec)

    step = weights()
    rows = dataclasses.replace(batch, advantages=step.raw_advantages, token_weights=step.token_weights)
    rows = rows.apply(lambda t: t.to(DEVICE))
    logprobs = (-torch.rand(OVERHEAD_ROWS, seq_len, generator=torch.Generator().manual_seed(3))).to(DEVICE)
    entropy = torch.rand(OVERHEAD_ROWS, seq_len).to(DEVICE)
    normalizer = torch.tensor(float(OVERHEAD_ROWS), device=DEVICE)

    def objective():
        leaf = logprobs.detach().requires_grad_()
        loss, _, _ = policy_objective(leaf, entropy, rows, spec, normalizer)
        loss.backward()

    batch.advantages, batch.token_weights = step.raw_advantages, step.token_weights
    train_s = _median_seconds(lambda: policy.train_step(batch, spec), repeats=min(3, REPEATS))
    weights_s, objective_s = _median_seconds(weights), _median_seconds(objective)
    table = f"GTPO step overhead, {OVERHEAD_ROWS} x {seq_len} tokens (groups of {GROUP_SIZE})"
    bench_row(table, part="training step (train_step)", ms=train_s * 1e3, **{"/ step": 1.0})
    bench_row(table, part="compute_weights (CPU)", ms=weights_s * 1e3, **{"/ step": weights_s / train_s})
    bench_row(table, part="policy_objective fwd+bwd", ms=objective_s * 1e3, **{"/ step": objective_s / train_s})
    record("test_bench_gtpo_overhead", "GTPO overhead / training step", (weights_s + objective_s) / train_s)


def test_bench_train_step(policy) -> None:
    from gtpo_megatron.ops import LossSpec

    loss, padded_vocab = LossSpec(**LOSS_KW), policy.geometry.padded_vocab_size
    table = f"training step, random {ARCH.name}, bf16, {policy.model.layer_spec_backend} specs, micro-batch 1"
    fitted = 0
    for seq_len in SEQ_LENGTHS:
        rows = max(1, TOKENS_PER_STEP // seq_len)
        batch = random_batch(ARCH, rows, seq_len)
        try:
            metrics = policy.train_step(batch, loss)  # warm-up (Megatron builds its optimizer state here)
            peak = float("nan")
            if DEVICE.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            seconds = _median_seconds(lambda batch=batch: policy.train_step(batch, loss), repeats=min(3, REPEATS))
            if DEVICE.type == "cuda":
                peak = torch.cuda.max_memory_allocated()
        except torch.OutOfMemoryError:
            policy.zero_grad()
            gc.collect()
            torch.cuda.empty_cache()
            bench_row(table, s=seq_len, **{"tokens/step": rows * seq_len, "step s": "out of memory"})
            break
        assert torch.isfinite(torch.tensor(metrics["loss"]))
        fitted, tokens_per_s = seq_len, rows * seq_len / seconds
        plan = plan_bytes(ARCH, seq_len, rows, padded_vocab)
        bench_row(table, s=seq_len, **{
            "tokens/step": rows * seq_len, "step s": seconds, "tokens/s": tokens_per_s,
            "MFU (989 TFLOP/s)": tokens_per_s * flops_per_token(ARCH, seq_len, padded_vocab) / PEAK_FLOPS,
            "peak GiB": peak / GIB, "plan GiB": plan / GIB, "peak/plan": peak / plan,
        })  # fmt: skip
    record("test_bench_train_step", "longest sequence that fits (micro-batch 1)", fitted)
    assert fitted >= SEQ_LENGTHS[0]
