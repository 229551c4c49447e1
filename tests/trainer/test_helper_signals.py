"""Helpers started mid-run survive SIGUSR1: torchrun passes the signal to each rank's whole process group, where it
must only ask the trainer to save (``preemption.stop_signals_held``). While the run's handlers are installed the
main thread has SIGUSR1 unblocked, so a reward worker or a restarted engine started there inherits its default
action (terminate) unless it is started inside ``stop_signals_held``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from gtpo_megatron.preemption import StopRequests, hold_stop_signals, release_stop_signals, stop_signals_held
from gtpo_megatron.rewards import RewardPool

_SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


@pytest.fixture
def mid_run():
    """The trainer's signal state during its steps: SIGUSR1 held from start-up, then handled in the loop."""
    hold_stop_signals()
    stops = StopRequests(on_sigterm=True, on_sigusr1=True)
    try:
        with stops.installed():
            yield stops
    finally:
        release_stop_signals()


def _dies_of_sigusr1(process: subprocess.Popen) -> bool:
    os.kill(process.pid, signal.SIGUSR1)
    try:
        return process.wait(timeout=2) == -signal.SIGUSR1
    except subprocess.TimeoutExpired:  # still running: it kept the signal pending
        process.kill()
        process.wait()
        return False


def test_a_process_started_inside_the_block_keeps_sigusr1_pending(mid_run):
    assert _dies_of_sigusr1(subprocess.Popen(_SLEEPER))  # the default action, as the trainer's children had it
    with stop_signals_held():
        sleeper = subprocess.Popen(_SLEEPER)
    assert not _dies_of_sigusr1(sleeper)
    assert not mid_run.save_requested


def test_a_sigusr1_for_the_main_thread_during_the_block_is_delivered_after_it(mid_run):
    """Thread-directed (a process-directed one may be taken at once by another thread: the handler runs either way)."""
    with stop_signals_held():
        signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)
        assert not mid_run.save_requested and signal.SIGUSR1 in signal.sigpending()
    assert mid_run.save_requested  # the mask is restored: the run's handler saw it


def test_reward_workers_started_mid_run_survive_sigusr1(mid_run):
    with RewardPool("paper", num_workers=2, timeout_s=5.0) as pool:
        workers = [worker.process for worker in pool._workers]
        for worker in workers:
            os.kill(worker.pid, signal.SIGUSR1)
        for worker in workers:
            worker.join(timeout=1)
            assert worker.is_alive() and worker.exitcode is None
        results, stats = pool.score(["<answer>12</answer>"] * 4, ["12"] * 4)
        assert [r.correct for r in results] == [True] * 4 and stats["num_errors"] == 0
        assert [worker.process for worker in pool._workers] == workers  # none replaced
