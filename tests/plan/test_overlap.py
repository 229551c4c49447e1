"""``plan.overlap``: the sync and async step-time model by hand, the split search, and its ``gtpo-plan`` line."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from gtpo_megatron.plan.overlap import Hardware, StepWork, best_split, generate_seconds, sync_step, train_seconds
from gtpo_megatron.plan_cli import run

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


class _Model:
    """A dense model of N = 1e9 parameters (all the time model reads of an ``Architecture``: its active ones)."""

    def active_params(self) -> int:
        return 10**9


HW = Hardware(peak_tflops=100.0, hbm_tbps=1.0, mfu=0.5)
WORK = StepWork(
    sequences=8, seq_length=1000, completion_tokens=500, weight_bytes=2 * 10**9, kv_bytes_per_token=10**5,
    engine_tp_size=1,
)  # fmt: skip


def test_phases_by_hand():
    # train: 6 * 1e9 * 8 * 1000 / (4 * 100e12 * 0.5) = 0.24 s
    assert train_seconds(_Model(), WORK, HW, gpus=4) == pytest.approx(0.24)
    # 2 engines, 4 sequences each at mean context 1000 - 250: (2e9 + 4 * 750 * 1e5) B / 1 TB/s = 2.3 ms a token
    # (compute 2 * 1e9 * 4 / 50e12 = 0.16 ms), 500 tokens
    assert generate_seconds(_Model(), WORK, HW, gpus=2) == pytest.approx(1.15)
    step = sync_step(_Model(), WORK, HW, gpus=4, sync_s=0.1)  # generation 500 * 2.15 ms with 4 engines
    assert (step.generate_s, step.train_s, step.step_s) == pytest.approx((1.075, 0.24, 1.415))


def test_partial_rollouts_generate_by_the_mean_completion_and_k():
    # k = 1, mean 200 of 500: 2 batches streamed, 8 sequences each over 2 engines (8 per engine) at context
    # 500 + 100 = 600: (2e9 + 8 * 600 * 1e5) B / 1 TB/s = 2.48 ms per decode step, 200 / 2 steps
    work = dataclasses.replace(WORK, mean_completion_tokens=200, batches_in_flight=2)
    assert generate_seconds(_Model(), work, HW, gpus=2) == pytest.approx(0.248)
    # the same mean, one batch at a time: 200 steps of 4 sequences at context 600 (2.24 ms)
    single = dataclasses.replace(WORK, mean_completion_tokens=200)
    assert generate_seconds(_Model(), single, HW, gpus=2) == pytest.approx(0.448)


def test_best_split_minimises_max_of_generation_and_training_plus_sync():
    # 1 + 3: max(500 * 2.225 ms, 0.96 + 0.1) = 1.1125; 2 + 2: max(1.15, 0.58) = 1.15; 3 + 1: dp 3 does not divide 8
    best = best_split(_Model(), WORK, HW, gpus=4, train_multiple=1, sync_s=0.1)
    assert (best.train_gpus, best.engine_gpus, best.step_s) == (1, 3, pytest.approx(1.1125))
    assert best_split(_Model(), WORK, HW, gpus=2, train_multiple=2, sync_s=0.1) is None  # no GPU left for an engine


def test_gtpo_plan_prints_both_steps_and_the_split():
    status, text = run(["--config", str(CONFIGS / "qwen2.5-32b_gsm8k_gtpo_32gpu.yaml"), "--gpus", "32",
                        "rollout.max_tokens=8192", "rollout.max_prompt_len=1024", "model.recompute=full"])  # fmt: skip
    line = next(row for row in text.splitlines() if row.startswith("step time model"))
    assert status == 0 and "sync colocated on 32 GPUs" in line, text
    assert "16 training + 16 engine GPUs (rollout.num_engine_gpus=16)" in line and line.endswith("x"), line
    status, text = run(["--config", str(CONFIGS / "qwen2.5-32b_gsm8k_gtpo_32gpu.yaml"), "--gpus", "32", "--mfu", "0"])
    assert status == 2 and "--mfu=0: must be in (0, 1]" in text
    partial = ["rollout.placement=separate", "rollout.num_engine_gpus=16", "rollout.mode=async",
               "rollout.partial_rollouts=true", "rollout.weight_sync=files",
               "algorithm.off_policy_correction=tis"]  # fmt: skip
    status, text = run(["--config", str(CONFIGS / "qwen2.5-32b_gsm8k_gtpo_32gpu.yaml"), "--gpus", "32", *partial,
                        "rollout.max_tokens=8192", "rollout.max_prompt_len=1024", "model.recompute=full"])  # fmt: skip
    line = next(row for row in text.splitlines() if row.startswith("step time model"))
    assert "(partial rollouts: mean completion 0.5 x rollout.max_tokens, 2 batches streamed)" in line, text
