"""``engine_processes``: a live tree passes, a stopped process or a dead root fails, a finished helper does not."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil
import pytest

from gtpo_megatron.rollout.engine_processes import check_processes, kill_processes

# a root that starts a helper which exits at once and is never reaped (a zombie child), then sleeps
ROOT = "import subprocess, time; p = subprocess.Popen(['true']); time.sleep(60)"


def _wait_for(predicate) -> None:
    deadline = time.monotonic() + 30
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert predicate()


def test_a_stopped_process_and_a_dead_root_fail_while_a_finished_helper_does_not():
    root = subprocess.Popen([sys.executable, "-c", ROOT])
    try:
        tree = psutil.Process(root.pid)
        _wait_for(lambda: any(c.status() == psutil.STATUS_ZOMBIE for c in tree.children()))
        check_processes([root.pid])  # the zombie helper is no failure
        root.send_signal(signal.SIGSTOP)
        _wait_for(lambda: tree.status() == psutil.STATUS_STOPPED)
        with pytest.raises(RuntimeError, match=f"engine process {root.pid} is stopped"):
            check_processes([root.pid])
        kill_processes([root.pid])  # SIGKILL works on a stopped process
        _wait_for(lambda: tree.status() == psutil.STATUS_ZOMBIE)
        with pytest.raises(RuntimeError, match=f"engine process {root.pid} is zombie"):
            check_processes([root.pid])
        root.wait(30)
        with pytest.raises(RuntimeError, match=f"engine process {root.pid} is gone"):
            check_processes([root.pid])
        with pytest.raises(RuntimeError, match="the engine has no process"):
            check_processes([])
    finally:
        root.kill()
        root.wait(30)
