"""The gloo harness: a failing rank still fails the test (with its traceback) now that a passing one leaves with
``os._exit(0)``, a passing rank's printed lines reach the caller (flushed before the exit), and processes a worker
started (a forked manager that ignores SIGTERM, as the checkpoint's write queue is; a daemonic child) are stopped
before it leaves: one left running holds the pipe ``mp.spawn`` waits on, and the call never returned."""

from __future__ import annotations

import pytest

from tests.helpers.dist_harness import run_distributed

pytestmark = pytest.mark.distributed

_STARTED = []  # a worker's live processes, alive until it leaves


def _rank_1_fails(rank, world_size):
    print(f"rank {rank} ran")
    assert rank != 1, "rank 1's check failed"


def _both_pass(rank, world_size):
    print(f"rank {rank} of {world_size} passed")


def test_a_failing_rank_fails_the_call_with_its_traceback():
    with pytest.raises(RuntimeError, match="(?s)rank 1 failed:.*rank 1's check failed"):
        run_distributed(_rank_1_fails, 2)


def test_passing_ranks_output_is_flushed(capfd):
    run_distributed(_both_pass, 2)
    out = capfd.readouterr().out
    assert "rank 0 of 2 passed" in out and "rank 1 of 2 passed" in out


def _forked_manager_and_daemon(rank, world_size):
    import multiprocessing
    import time

    from gtpo_megatron.preemption import start_helper_manager

    manager = start_helper_manager()
    daemon = multiprocessing.get_context("fork").Process(target=time.sleep, args=(3600,), daemon=True)
    daemon.start()
    _STARTED.append((manager.Queue(), daemon))  # kept alive, as the checkpoint keeps its queue's proxy


@pytest.mark.timeout(120)  # the failure this guards against is a call that never returns
def test_processes_a_worker_started_do_not_keep_the_call_waiting():
    run_distributed(_forked_manager_and_daemon, 2)
