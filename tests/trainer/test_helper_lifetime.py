"""What a trainer leaves behind when it dies by SIGKILL: its write-queue manager ends with it
(``preemption.start_helper_manager``), and its weight staging folder is removed by the next run's sweep
(``rollout/staging.py``), while a live run's folder is kept."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

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
