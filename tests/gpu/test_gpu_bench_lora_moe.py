"""GPU benchmarks of what landed after the first bench group (``run_gpu_checks.sh --bench``): LoRA and MoE.

* LoRA against full fine-tuning: the bf16 training step of the bench group's random Qwen2.5-1.5B at sequence 2,048,
  full and with the paper's adapters (rank :data:`LORA_RANK`, alpha = rank, all seven projections), each policy
  built, timed and freed in turn: tokens/s, peak memory and ``gtpo-plan``'s estimate of each.
* A mixture-of-experts stack at EP 1: :data:`MOE_ARCH`, Qwen3-30B-A3B's layer (128 experts of width 768, top-8,
  q/k norms) in :data:`MOE_LAYERS` layers, Megatron's local MoE layer (``SequentialMLP`` without Transformer
  Engine): tokens/s, MFU over the active parameters, peak memory against ``gtpo-plan``.

A dry run uses tiny sizes on the CPU (no CUDA memory numbers).
"""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

from gtpo_megatron.plan.architectures import KNOWN_ARCHITECTURES
from tests.gpu.bench_common import (
    GIB,
    PEAK_FLOPS,
    flops_per_token,
    median_seconds,
    plan_bytes,
    random_batch,
    random_policy,
)
from tests.gpu.common import DEVICE, DRY_RUN, loss_spec
from tests.gpu.report import bench_row, record

pytestmark = pytest.mark.gpu
TINY = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2, head_dim=16,
            vocab_size=1024)  # fmt: skip
DENSE_ARCH = KNOWN_ARCHITECTURES["Qwen2.5-1.5B-Instruct"]
MOE_LAYERS = 2
MOE_ARCH = dataclasses.replace(KNOWN_ARCHITECTURES["Qwen3-30B-A3B"], num_layers=MOE_LAYERS)
LORA_RANK = 128
if DRY_RUN:
    DENSE_ARCH = dataclasses.replace(DENSE_ARCH, **TINY)
    MOE_ARCH = dataclasses.replace(MOE_ARCH, **TINY, num_experts=4, expert_ffn_size=32, top_k=2)
    LORA_RANK = 8
SEQ_LEN, ROWS = (64, 2) if DRY_RUN else (2048, 8)
REPEATS = 1 if DRY_RUN else 3


def _measure(policy, arch, *, lora_rank: int | None = None) -> dict[str, float]:
    """Time ``REPEATS`` training steps of ``ROWS`` x ``SEQ_LEN`` after a warm-up; tokens/s, MFU and memory."""
    batch, padded_vocab = random_batch(arch, ROWS, SEQ_LEN), policy.geometry.padded_vocab_size
    metrics = policy.train_step(batch, loss_spec())  # warm-up: Megatron builds its optimizer state here
    assert torch.isfinite(torch.tensor(metrics["loss"]))
    if DEVICE.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seconds = median_seconds(lambda: policy.train_step(batch, loss_spec()), repeats=REPEATS)
    peak = torch.cuda.max_memory_allocated() if DEVICE.type == "cuda" else float("nan")
    tokens_per_s = ROWS * SEQ_LEN / seconds
    plan = plan_bytes(arch, SEQ_LEN, ROWS, padded_vocab, lora_rank=lora_rank)
    return {"step s": seconds, "tokens/s": tokens_per_s,
            "MFU (989 TFLOP/s)": tokens_per_s * flops_per_token(arch, SEQ_LEN, padded_vocab) / PEAK_FLOPS,
            "peak GiB": peak / GIB, "plan GiB": plan / GIB, "peak/plan": peak / plan}  # fmt: skip


def _free(policy) -> None:
    del policy
    gc.collect()
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()


def test_bench_lora_vs_full_train_step(groups, tmp_path_factory) -> None:
    table = f"LoRA vs full fine-tuning, random {DENSE_ARCH.name}, bf16, {ROWS} x {SEQ_LEN} tokens a step"
    rows = {}
    for name, rank in (("full", None), (f"LoRA r{LORA_RANK} all-linear", LORA_RANK)):
        policy = random_policy(groups, DENSE_ARCH, tmp_path_factory.mktemp("dense"), lora_rank=rank)
        trainable = sum(p.numel() for p in policy.model.parameters() if p.requires_grad)
        rows[name] = {**_measure(policy, DENSE_ARCH, lora_rank=rank), "trainable M": trainable / 1e6}
        _free(policy)
    full = rows["full"]
    for name, row in rows.items():
        ratios = {"t/full": row["step s"] / full["step s"], "peak/full": row["peak GiB"] / full["peak GiB"]}
        bench_row(table, variant=name, **row, **ratios)
    lora = rows[f"LoRA r{LORA_RANK} all-linear"]
    record("test_bench_lora_vs_full_train_step", "LoRA step time / full", lora["step s"] / full["step s"])
    assert lora["trainable M"] < full["trainable M"]


def test_bench_moe_train_step(groups, tmp_path_factory) -> None:
    policy = random_policy(groups, MOE_ARCH, tmp_path_factory.mktemp("moe"))
    table = (f"MoE training step, {MOE_ARCH.name} layers x {MOE_LAYERS}, EP 1, bf16, "
             f"{policy.model.layer_spec_backend} specs, {ROWS} x {SEQ_LEN} tokens a step")  # fmt: skip
    row = _measure(policy, MOE_ARCH)
    bench_row(table, experts=f"{MOE_ARCH.num_experts} (top-{MOE_ARCH.top_k})", **row)
    record("test_bench_moe_train_step", "MoE tokens/s (EP 1)", row["tokens/s"])
    _free(policy)
