"""Rollout routing replay in the real loop: ``torchrun --nproc_per_node=2`` on ``builtin:tiny-qwen3-moe`` at EP=2 with
bf16 parameters and bf16 vLLM rollouts, 3 GTPO steps with ``rollout.routing_replay`` off and then ``rollout``.

With replay the engine's experts (captured on CPU by one prefill per completion) reach the training forward through
the exchange, and the train/rollout mismatch (``mismatch/abs_logprob_diff``) is not larger than without: bf16 flips
some routing decisions between the engine and the trainer, which replay takes back. The routing agreement is logged
(``mismatch/routing_agreement``, < 1 in bf16). Two runs of ~90 s each on the 2-core machine, hence the slow leg.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def _run(out: Path, routing_replay: str) -> list[dict]:
    from tests.helpers.dist_harness import free_port

    torchrun = Path(sys.executable).with_name("torchrun")
    overrides = [
        "model=builtin:tiny-qwen3-moe", "model.pad_attention_heads=false", "model.params_dtype=bfloat16",
        "parallel.tp_size=1", "parallel.ep_size=2", "rollout.dtype=bfloat16", "trainer.max_steps=3",
        "rollout.max_tokens=16", "algorithm.group_size=4", "checkpoint.every_n_steps=0", "logging.progress=false",
        f"rollout.routing_replay={routing_replay}", f"output_dir={out}",
    ]  # fmt: skip
    cmd = [str(torchrun), "--nproc_per_node=2", f"--master_port={free_port()}", "-m", "gtpo_megatron.train",
           "--config", str(REPO / "configs" / "cpu_demo.yaml"), *overrides]  # fmt: skip
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    return records


def test_routing_replay_does_not_increase_the_bf16_train_rollout_mismatch(tmp_path):
    plain = _run(tmp_path / "off", "off")
    replayed = _run(tmp_path / "rollout", "rollout")
    off = [r["mismatch/abs_logprob_diff"] for r in plain]
    on = [r["mismatch/abs_logprob_diff"] for r in replayed]
    agreement = [r["mismatch/routing_agreement"] for r in replayed]
    times = [(r["time/generate_s"], q["time/generate_s"]) for r, q in zip(plain, replayed)]
    print(f"[routing replay loop] mismatch off {off} on {on}; agreement {agreement}; generate s (off, on) {times}")
    assert all("mismatch/routing_agreement" not in r for r in plain)
    assert all(0.5 < a <= 1.0 for a in agreement), agreement
    assert sum(on) <= sum(off), (on, off)
    assert all(math.isfinite(r["train/grad_norm"]) and r["train/grad_norm"] > 0 for r in replayed)
