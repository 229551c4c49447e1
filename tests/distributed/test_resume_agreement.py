"""Ranks shown different checkpoint folders (node-local output folders, stale network-filesystem attributes) resume
the same step or all stop naming the disagreement (gloo, 2 processes)."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from gtpo_megatron import run_dir
from gtpo_megatron.resume import agreed_checkpoint
from tests.helpers.dist_harness import run_distributed

pytestmark = pytest.mark.distributed


def _make(root, *steps, complete=True):
    for step in steps:
        folder = root / f"step_{step:06d}"
        folder.mkdir(parents=True)
        (folder / "common.pt").write_bytes(b"c" * 10)
        if complete:
            run_dir.mark_complete(folder)


def _worker(rank, world_size, base):
    group = dist.group.WORLD
    # rank 0 sees steps 2 and 3, rank 1 steps 3 and 4 (a newer one rank 0 lacks): both follow rank 0's step 3
    root = base / f"follow{rank}"
    _make(root, *((2, 3) if rank == 0 else (3, 4)))
    assert agreed_checkpoint(root, rank=rank, group=group) == root / "step_000003"
    # rank 1 sees step 3 unfinished: every rank stops, naming rank 0's choice and rank 1's own newest (step 2)
    root = base / f"stop{rank}"
    _make(root, 2)
    _make(root, 3, complete=rank == 0)
    started = time.perf_counter()
    with pytest.raises(RuntimeError) as stopped:
        agreed_checkpoint(root, rank=rank, group=group)
    print(f"rank {rank}: from the fault to the error in {time.perf_counter() - started:.3f} s")
    message = str(stopped.value)
    assert "rank 0 chose step_000003" in message and "rank 1 (no complete.json" in message
    assert "its newest complete: step_000002" in message
    # step 1000000 is newer than step 999999 on every rank
    root = base / f"million{rank}"
    _make(root, 999999, 1000000)
    assert agreed_checkpoint(root, rank=rank, group=group) == root / "step_1000000"
    # nothing on rank 0, a checkpoint on rank 1: rank 1 cannot follow a fresh start silently
    root = base / f"fresh{rank}"
    _make(root, *(() if rank == 0 else (5,)))
    with pytest.raises(RuntimeError, match="rank 0 chose a fresh start .* rank 1 \\(rank 0 sees no complete"):
        agreed_checkpoint(root, rank=rank, group=group)
    dist.barrier(group=group)


def test_ranks_follow_rank_0s_checkpoint_or_stop_together(tmp_path):
    run_distributed(_worker, 2, tmp_path)


def test_one_process_takes_its_newest(tmp_path):
    _make(tmp_path, 999999, 1000000)
    assert agreed_checkpoint(tmp_path, rank=0, group=None) == tmp_path / "step_1000000"
    assert agreed_checkpoint(tmp_path / "none", rank=0, group=None) is None
