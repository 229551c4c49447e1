"""``examples/megatron_core_loop.py`` runs as a user would run it: 2 GTPO steps on CPU with the real vLLM engine.

The example builds its own GPTModel with Megatron-Core's API, trains it with a torch optimizer through the plugin
API, and syncs it into a vLLM engine started with dummy weights; so a train/rollout mismatch near 0 in both steps
also shows that ``plugin.sync_weights`` reached the engine. About 1-2 minutes on 2 cores, mostly vLLM's start.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
KEYS = {
    "gtpo/loss",
    "gtpo/clip_frac",
    "gtpo/entropy_mean",
    "gtpo/kept_frac",
    "reward/mean",
    "mismatch/abs_logprob_diff",
}


def test_example_runs_two_gtpo_steps():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "megatron_core_loop.py")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in lines] == ["step 1", "step 2"], proc.stdout[-3000:]
    for line in lines:
        metrics = {k: float(v) for k, v in re.findall(r"([\w/]+)=(-?[\d.]+(?:e-?\d+)?)", line)}
        assert KEYS <= set(metrics), line
        assert all(math.isfinite(v) for v in metrics.values()), line
        assert metrics["mismatch/abs_logprob_diff"] < 0.05, line  # the engine samples with the synced weights
        assert 9.0 < metrics["gtpo/entropy_mean"] < math.log(49152) + 1e-3  # a random model over 49,152 tokens
