"""Async rollouts under torchrun: SIGTERM mid-run, then a resume that loses and repeats no prompt.

``torchrun --nproc_per_node=2`` jobs of ``preemption_job.py`` (the real entry point and Megatron policy
``builtin:tiny-qwen2`` at TP=2 on gloo; the fake engine, whose completions depend on neither weights nor seeds, and
fake rewards) with ``rollout.mode=async``, ``max_staleness=1``, 6 steps, a checkpoint every 2:
1. uninterrupted, the reference;
2. SIGTERM while rank 0's worker generates batch 4 for 120 s (the trainer trains step 3 meanwhile, queues its
   weights and batch 5, then waits for batch 4 at take): the job saves the last completed step (2 if the signal
   came before step 3's update, else 3) within torchrun's 30 s grace, with the batches in flight listed
   (``rollout_in_flight``: k+1 of them, or one when the signal came during step 3's update and skipped its push);
3. ``resume=true``: the in-flight batches are sampled again from the saved loader position, and every resumed step
   gives exactly the reference's numbers (they differ from step to step with the prompts: a lost or repeated
   prompt would shift them).
About 3 min on the shared 2-core machine, mostly imports.
"""

from __future__ import annotations

import signal
import time

import pytest
from megatron.core import dist_checkpointing

from gtpo_megatron import run_dir
from tests.distributed.test_preemption_torchrun import COMPARED, GRACE_S, _finish, _metrics, _signal_when_generating
from tests.distributed.test_preemption_torchrun import _slow_call as slow_call
from tests.distributed.test_preemption_torchrun import _start as start_job

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
ASYNC = ("rollout.placement=separate", "rollout.mode=async", "rollout.max_staleness=1")


def _trainer_state(folder) -> dict:
    return dist_checkpointing.load_common_state_dict(str(folder))["trainer_state"]


def test_sigterm_in_an_async_run_then_resume_loses_and_repeats_no_prompt(tmp_path):
    reference, cut = tmp_path / "reference", tmp_path / "cut"
    proc = start_job(reference, tmp_path / "reference.log", *ASYNC)
    output = _finish(proc, tmp_path / "reference.log")
    assert proc.returncode == 0, output[-4000:]
    expected = _metrics(reference)
    assert [expected[s]["async/staleness_mean"] for s in sorted(expected)] == [0, 1, 1, 1, 1, 1]
    assert len({expected[s]["train/loss"] for s in expected}) == 6  # each step's prompts give their own numbers

    marker, log = tmp_path / "batch4_generating", tmp_path / "cut.log"
    proc = start_job(cut, log, *ASYNC, env=slow_call(4, 120, marker))  # call 4 = batch 4 (submitted after step 2)
    killed = _signal_when_generating(proc, marker, log, signal.SIGTERM)
    output = _finish(proc, log, timeout=GRACE_S + 30)
    assert time.time() - killed < GRACE_S, output[-4000:]
    root = run_dir.checkpoints_dir(cut)
    saved = int(run_dir.list_checkpoints(root)[-1].name[5:])
    assert saved in (2, 3), output[-4000:]
    state = _trainer_state(root / f"step_{saved:06d}")
    # the signal during step 3's update skips its push (batch 5 never queued); otherwise a step aborts at a safe point
    pushed = state["rollout_in_flight"] == [saved + 1, saved + 2]  # queued, never trained
    assert pushed or (saved, state["rollout_in_flight"]) == (3, [4]), state
    message = f"step {saved + 1} aborted; step {saved} saved" if pushed else "saved step 3 and stopped"
    assert f"SIGTERM: {message}; resume with resume=true" in output, output[-4000:]
    assert sorted(_metrics(cut)) == list(range(1, saved + 1))

    log = tmp_path / "resume.log"
    proc = start_job(cut, log, *ASYNC, "resume=true")
    output = _finish(proc, log)
    assert proc.returncode == 0, output[-4000:]
    assert f"sampling the in-flight batches of steps {state['rollout_in_flight']} again" in output, output[-4000:]
    got = _metrics(cut)
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    for step in range(saved + 1, 7):
        assert {k: got[step][k] for k in COMPARED} == {k: expected[step][k] for k in COMPARED}, step
