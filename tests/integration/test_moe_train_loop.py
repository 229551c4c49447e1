"""A mixture-of-experts policy in the real loop: ``torchrun --nproc_per_node=2`` on ``builtin:tiny-qwen3-moe``
(8 experts a layer) with expert parallelism 2 (each rank holds 4 experts of every layer), vLLM rollouts on rank 0 and
the default weight sync (sharded: each rank sends its own experts), fp32 on both sides, 3 GTPO steps.

After every sync the engine samples with the trainer's weights: the rollout log-probs the engine reports equal the
trainer's recomputation (``mismatch/abs_logprob_diff``; 3e-7 to 5e-7 measured) at every step, so every expert of
both EP ranks reached the engine under its HF name, and the CPU backend's experts were re-packed after each reload.
About 90 s on the 2-core machine (imports, one engine start), hence the slow leg.
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


def test_expert_parallel_run_keeps_the_engine_on_the_trainer_weights(tmp_path):
    from tests.helpers.dist_harness import free_port

    torchrun = Path(sys.executable).with_name("torchrun")
    overrides = [
        "model=builtin:tiny-qwen3-moe", "model.pad_attention_heads=false", "parallel.tp_size=1",
        "parallel.ep_size=2", "rollout.dtype=float32", "trainer.max_steps=3", "rollout.max_tokens=16",
        "algorithm.group_size=4", "checkpoint.every_n_steps=0", "logging.progress=false", f"output_dir={tmp_path}",
    ]  # fmt: skip
    cmd = [str(torchrun), "--nproc_per_node=2", f"--master_port={free_port()}", "-m", "gtpo_megatron.train",
           "--config", str(REPO / "configs" / "cpu_demo.yaml"), *overrides]  # fmt: skip
    env = {**os.environ, "WANDB_MODE": "offline"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    # no push after the last step: the engine only ever samples for a step that trains
    assert [r.get("sync/num_tensors") for r in records] == [69, 69, None]
    for record in records:
        # 69 = 2 layers x (4 attention + 2 q/k norms + 2 norms + router + 8 experts x 3) + embedding, head, final norm
        assert record["mismatch/abs_logprob_diff"] < 1e-5, record
        assert math.isfinite(record["train/grad_norm"]) and record["train/grad_norm"] > 0
