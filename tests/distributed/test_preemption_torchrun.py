"""Preemption end to end: torchrun stops a 2-rank job in the middle of a step.

Three ``torchrun --nproc_per_node=2`` jobs of ``preemption_job.py`` (the real entry point, Megatron policy
``builtin:tiny-qwen2`` at TP=2 on gloo, checkpoints; fake engine and rewards), 6 steps, a checkpoint every 2:
1. uninterrupted, the reference;
2. SIGTERM: while rank 0 is in a 120 s generation of step 4, torchrun gets SIGTERM, forwards it to each worker's
   process group (children included, like Slurm) and SIGKILLs them after its 30 s grace (``--shutdown-timeout``;
   Slurm's ``KillWait`` is the same 30 s). Within the grace the job must have written a complete ``step_000003``
   (the last completed step; no periodic save writes it), although the checkpoint writer's helper process of the
   step-2 save was alive when the signal came (megatron-core's own one dies on SIGTERM: the save then fails with
   BrokenPipeError), and no ``step_000004``;
3. ``resume=true`` under ``launch/submit.sbatch``'s torchrun flags (``--signals-to-handle`` with SIGUSR1): SIGUSR1
   while rank 0 generates step 5; step 5 finishes and is saved (no periodic save writes it), no step 6 runs, and
   steps 4 and 5 give exactly the reference's numbers (loss, gradient norm, entropy, rewards).
About 2-3 min on the shared 2-core machine, mostly imports.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gtpo_megatron import run_dir
from tests.helpers.dist_harness import free_port

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # three torchrun jobs, one with a 120 s stalled call

REPO = Path(__file__).resolve().parents[2]
GRACE_S = 30  # torchrun's default --shutdown-timeout
SUBMIT_FLAGS = ("--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", "--shutdown-timeout=60")
COMPARED = (
    "train/loss", "train/grad_norm", "train/lr", "entropy/completion_mean", "reward/mean", "advantage/abs_mean"
)  # fmt: skip


def _start(output_dir: Path, log: Path, *overrides: str, env=None, torchrun_flags=()) -> subprocess.Popen:
    cmd = [
        str(Path(sys.executable).with_name("torchrun")),
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        *torchrun_flags,
        str(REPO / "tests" / "distributed" / "preemption_job.py"),
        "--config",
        str(REPO / "configs" / "cpu_demo.yaml"),
        "model=builtin:tiny-qwen2",
        "parallel.tp_size=2",
        "trainer.max_steps=6",
        "rollout.num_prompts=2",
        "algorithm.group_size=4",
        "checkpoint.every_n_steps=2",
        "logging.wandb_mode=disabled",
        "logging.progress=false",
        "rollout.weight_sync=files",  # the fake engine takes buckets, it joins no weight group
        f"output_dir={output_dir}",
        *overrides,
    ]
    handle = log.open("w")
    return subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **(env or {})}, stdout=handle, stderr=subprocess.STDOUT)


def _finish(proc: subprocess.Popen, log: Path, timeout: float = 400) -> str:
    proc.wait(timeout=timeout)
    return log.read_text()


def _metrics(output_dir: Path) -> dict[int, dict]:
    records = [json.loads(line) for line in run_dir.metrics_path(output_dir).read_text().splitlines()]
    return {r["step"]: r for r in records}


def _signal_when_generating(proc: subprocess.Popen, marker: Path, log: Path, signum: int) -> float:
    """Send ``signum`` to torchrun once rank 0 touched ``marker`` (inside the slow generation); returns the time."""
    deadline = time.monotonic() + 400
    while not marker.exists():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.5)
    sent = time.time()
    proc.send_signal(signum)
    return sent


def _slow_call(call: int, seconds: float, marker: Path) -> dict:
    return {"GTPO_TEST_SLOW_CALL": str(call), "GTPO_TEST_SLOW_S": str(seconds), "GTPO_TEST_MARKER": str(marker)}


def test_stop_signals_mid_step_save_within_the_grace_and_resume_exactly(tmp_path):
    reference, cut = tmp_path / "reference", tmp_path / "cut"
    proc = _start(reference, tmp_path / "reference.log")
    output = _finish(proc, tmp_path / "reference.log")
    assert proc.returncode == 0, output[-4000:]

    marker, log = tmp_path / "step4_generating", tmp_path / "cut.log"
    proc = _start(cut, log, env=_slow_call(4, 120, marker))
    killed = _signal_when_generating(proc, marker, log, signal.SIGTERM)  # torchrun: SIGKILL after GRACE_S
    output = _finish(proc, log, timeout=GRACE_S + 30)
    ended = time.time() - killed
    assert "SIGTERM: step 4 aborted; step 3 saved; resume with resume=true" in output, output[-4000:]
    root = run_dir.checkpoints_dir(cut)
    assert [p.name for p in run_dir.list_checkpoints(root)] == ["step_000002", "step_000003"]
    saved = (root / "step_000003" / run_dir.COMPLETE_MARKER).stat().st_mtime - killed
    assert 0 < saved < GRACE_S, f"step 3 saved {saved:.1f} s after SIGTERM; torchrun SIGKILLs at {GRACE_S} s"
    assert not (root / "step_000004").exists() and sorted(_metrics(cut)) == [1, 2, 3]
    print(f"[preemption] SIGTERM mid-step 4 -> step 3 saved {saved:.1f} s later; the job ended after {ended:.1f} s")

    marker, log = tmp_path / "step5_generating", tmp_path / "resume.log"
    proc = _start(cut, log, "resume=true", env=_slow_call(2, 8, marker), torchrun_flags=SUBMIT_FLAGS)
    warned = _signal_when_generating(proc, marker, log, signal.SIGUSR1)
    output = _finish(proc, log)
    assert "SIGUSR1: saved step 5 and stopped; resume with resume=true" in output, output[-4000:]
    assert [p.name for p in run_dir.list_checkpoints(root)] == ["step_000004", "step_000005"]
    assert (root / "step_000005" / run_dir.COMPLETE_MARKER).stat().st_mtime > warned
    expected, got = _metrics(reference), _metrics(cut)
    assert sorted(got) == [1, 2, 3, 4, 5]
    for step in (4, 5):
        assert {k: got[step][k] for k in COMPARED} == {k: expected[step][k] for k in COMPARED}, step
