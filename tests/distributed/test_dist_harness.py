"""The gloo harness: a failing rank still fails the test (with its traceback) now that a passing one leaves with
``os._exit(0)``, and a passing rank's printed lines reach the caller (flushed before the exit)."""

from __future__ import annotations

import pytest

from tests.helpers.dist_harness import run_distributed

pytestmark = pytest.mark.distributed


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
