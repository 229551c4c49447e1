"""What a trainer leaves behind when it dies by SIGKILL: its write-queue manager ends with it
(``preemption.start_helper_manager``), so does a reward worker started by a thread other than the main one, and its
weight staging folder is removed by the next run's sweep (``rollout/staging.py``), while a live run's folder is
kept. A helper started by a thread that ends before the trainer (a partial-rollout batch's) lives on."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from gtpo_megatron.rewards import RewardPool
from gtpo_megatron.rollout.staging import PREFIX, open_staging_dir, sweep_staging_dirs

_TRAINER = """
import multiprocessing, sys, time
from gtpo_megatron.preemption import start_helper_manager
from gtpo_megatron.rollout.staging import open_staging_dir

class Engine:
    pass

engine = Engine()
manager = start_helper_manager()
queue = manager.Queue()
staging, _ = open_staging_dir(engine, sys.argv[1])
(helper,) = multiprocessing.active_children()
print(helper.pid, staging, flush=True)
time.sleep(600)
"""


_THREAD_STARTED = """
import threading, time
from gtpo_megatron.rewards import RewardPool

pool = RewardPool("paper", num_workers=1, timeout_s=5.0)
pool._retire(0)  # the next score starts the slot's worker in the scoring thread
scoring = threading.Thread(target=pool.score, args=(["<answer>1</answer>"], ["1"]))
scoring.start()
scoring.join()
print(pool._workers[0].process.pid, flush=True)
time.sleep(600)
"""


class _Engine:
    """The owner of a staging folder."""


def _ended(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie counts: its parent, init, has not reaped it yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_killed_trainer_leaves_no_helper_process_and_no_staging_folder(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), *sys.path])}
    command = [sys.executable, "-c", _TRAINER, str(tmp_path)]
    trainer = subprocess.Popen(command, stdout=subprocess.PIPE, env=env, text=True)
    try:
        manager_pid, staging = trainer.stdout.readline().split()
        manager_pid, staging = int(manager_pid), Path(staging)
        assert staging.parent == tmp_path and staging.name.startswith(f"{PREFIX}{trainer.pid}-")
        assert sweep_staging_dirs(tmp_path) == [] and not _ended(manager_pid)  # a live run's are kept
    finally:
        trainer.kill()
        trainer.wait()
    deadline = time.monotonic() + 60  # generous: the manager ends at once (PR_SET_PDEATHSIG) or within a second
    while not _ended(manager_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _ended(manager_pid), "the write-queue manager outlived its trainer"
    assert staging.is_dir()  # SIGKILL: nothing ran in the trainer
    owner = _Engine()
    mine, _ = open_staging_dir(owner, tmp_path)  # the next run sweeps it
    assert not staging.exists() and [p.name for p in tmp_path.iterdir()] == [mine.name]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), *sys.path])}


def test_a_reward_worker_started_by_a_thread_that_ends_keeps_serving():
    """Partial rollouts score each batch in a thread of its own, which replaces a worker that timed out or died:
    ``PR_SET_PDEATHSIG`` follows the starting thread, so such a worker was killed as the thread ended."""
    with RewardPool("paper", num_workers=1, timeout_s=5.0) as pool:
        pool._retire(0)
        scoring = threading.Thread(target=pool.score, args=(["<answer>12</answer>"], ["12"]))
        scoring.start()
        scoring.join(60)
        (worker,) = pool._workers
        worker.process.join(timeout=2)  # generous: the signal arrives as the thread ends
        assert worker.process.exitcode is None, "the worker died with the thread that started it"
        results, stats = pool.score(["<answer>12</answer>"] * 2, ["12"] * 2)
        assert [r.correct for r in results] == [True, True] and stats["num_errors"] == 0
        assert pool._workers[0] is worker


def test_a_reward_worker_started_by_another_thread_still_ends_with_a_killed_trainer():
    trainer = subprocess.Popen([sys.executable, "-c", _THREAD_STARTED], stdout=subprocess.PIPE, env=_env(), text=True)
    try:
        worker_pid = int(trainer.stdout.readline())
        assert not _ended(worker_pid)
    finally:
        trainer.kill()
        trainer.wait()
    deadline = time.monotonic() + 60  # generous: its parent watch polls every second
    while not _ended(worker_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _ended(worker_pid), "the reward worker outlived its trainer"
