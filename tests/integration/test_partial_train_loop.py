"""Partial rollouts end to end: ``torchrun -m gtpo_megatron.train`` with two training ranks (data parallel) and two
separate CPU engines (``AsyncVLLMEngine``, one led by each rank) on ``builtin:tiny-qwen2``, with fault tolerance, so
the weights travel the collective path; 3 steps with k = 1: the weights after step 1 load into both engines in
flight (each paused around the whole sync, health-checked meanwhile) while batches 2 and 3 generate, and every step
logs its token-version histogram.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_train_loop import REPO, _free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_partial_rollouts_on_two_engines_with_fault_tolerance_train_with_versioned_tokens(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [
        str(torchrun), "--nproc_per_node=2", f"--master_port={_free_port()}", "-m", "gtpo_megatron.train",
        "--config", str(REPO / "configs" / "cpu_demo.yaml"), "model=builtin:tiny-qwen2", "trainer.max_steps=3",
        "parallel.tp_size=1", "model.pad_attention_heads=false",
        "rollout.max_tokens=64", "algorithm.group_size=4", "checkpoint.every_n_steps=0", f"output_dir={tmp_path}",
        "rollout.placement=separate", "rollout.mode=async", "rollout.partial_rollouts=true",
        "rollout.num_engines=2", "rollout.num_engine_gpus=2", "rollout.num_prompts=2",
        "rollout.fault_tolerance=true",
        "algorithm.off_policy_correction=tis",
    ]  # fmt: skip
    env = {**os.environ, "WANDB_MODE": "offline"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["async/staleness_max"] == 0.0 and rows[0]["async/version_frac_lag0"] == 1.0
    for row in rows:
        fractions = row["async/version_frac_lag0"] + row["async/version_frac_lag1"]
        assert abs(fractions - 1.0) < 1e-9 and row["async/stale_tokens"] == 0.0
    assert "async/pause_s" in rows[0]  # the push after step 1 loaded in flight
    assert all(row["rollout/engines_alive"] == 2 and row["rollout/engine_restarts"] == 0 for row in rows)
    log = proc.stdout + proc.stderr
    assert "rollout.weight_sync=collective (auto: sharded does not apply with rollout.fault_tolerance)" in log
