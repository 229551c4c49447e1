"""Stop signals in the loop (``preemption``, ``Trainer.run``): where SIGTERM, SIGINT and SIGUSR1 land decides what is
saved.

SIGTERM and SIGINT (Ctrl-C) abort the step in flight at its next wait or safe point and save the last completed
step (a step whose update began is finished, without its sync); SIGUSR1 finishes the step and saves it. Each case
sends the signal to this process from inside one phase of step 3 (4 steps, no periodic save), then checks the
saved step, what the policy trained and the engine synced, and that a resumed run continues with exactly the
prompts of an uninterrupted one. The torchrun version (2 ranks, real policy) is
``tests/distributed/test_preemption_torchrun.py``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time

import pytest

from gtpo_megatron.preemption import (
    ABORT_SIGNALS,
    StepInterrupted,
    StopRequests,
    hold_stop_signals,
    release_stop_signals,
    wait_until,
)
from gtpo_megatron.run_dir import list_checkpoints
from tests.trainer.fakes import FakeEngine, FakePolicy, make_trainer, one_rank_process_group

one_rank_world = pytest.fixture(scope="module", autouse=True)(one_rank_process_group)


class _SignalEngine(FakeEngine):
    """Sends ``signum`` to this process at the start of generate call ``at``, then generates for 30 s."""

    def __init__(self, at: int | None, signum: int):
        super().__init__()
        self.at, self.signum, self.seconds = at, signum, 0.0

    def generate(self, prompt_ids, n, sampling, prompt_indices=None):
        if len(self.calls) + 1 == self.at:
            start = time.perf_counter()
            os.kill(os.getpid(), self.signum)
            if self.signum in ABORT_SIGNALS:
                time.sleep(30)  # a long generation: SIGTERM or SIGINT must leave it at once
            self.seconds = time.perf_counter() - start
        return super().generate(prompt_ids, n, sampling, prompt_indices)


class _SignalPolicy(FakePolicy):
    """Sends ``signum`` to this process inside call ``at`` of ``phase`` (``compute_logprobs`` or ``train_step``)."""

    def __init__(self, phase: str | None, at: int | None, signum: int):
        super().__init__()
        self.phase, self.at, self.signum, self.counts = phase, at, signum, {}

    def _maybe_signal(self, phase):
        self.counts[phase] = self.counts.get(phase, 0) + 1
        if phase == self.phase and self.counts[phase] == self.at:
            os.kill(os.getpid(), self.signum)

    def compute_logprobs(self, batch, *, temperature=1.0, entropy_temperature=None):
        self._maybe_signal("compute_logprobs")
        return super().compute_logprobs(batch, temperature=temperature, entropy_temperature=entropy_temperature)

    def train_step(self, batch, loss):
        self._maybe_signal("train_step")
        return super().train_step(batch, loss)


def _run(tmp_path, *overrides, engine=None, policy=None):
    # <H>_ini measured over all 4 steps: every step runs its old-logprob pass (algorithm.needs_old_logprob_pass)
    trainer = make_trainer(
        tmp_path, "checkpoint.every_n_steps=0", "algorithm.initial_entropy_steps=4", *overrides, engine=engine,
        policy=policy,
    )  # fmt: skip
    trainer.run()
    return trainer


def _steps_logged(run_dir):
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# (phase, its call that belongs to step 3) -> (saved step, optimizer updates done, weight syncs done);
# compute_logprobs runs once a step (log-probs at T = 0.9 and entropy at T_H = 1 from one forward). SIGINT (Ctrl-C)
# is handled as SIGTERM.
CASES = {
    "abort in the rollout": ("generate", 3, 2, 2, 2),
    "abort in the old-logprob pass": ("compute_logprobs", 3, 2, 2, 2),
    "abort in the update": ("train_step", 3, 3, 3, 2),  # the update began: finish and save it, skip the sync
    "SIGUSR1 in the rollout": ("generate", 3, 3, 3, 3),  # the step finishes, then saves
}
SIGNALS = {case: ABORT_SIGNALS if case.startswith("abort") else (signal.SIGUSR1,) for case in CASES}


@pytest.mark.parametrize(
    ("case", "signum"), [(c, s) for c in sorted(CASES) for s in SIGNALS[c]], ids=lambda v: getattr(v, "name", v)
)
def test_stop_signals_save_the_last_completed_step(tmp_path, case, signum, caplog):
    phase, at, saved, updates, syncs = CASES[case]
    engine = _SignalEngine(at if phase == "generate" else None, signum)
    policy = _SignalPolicy(phase, at, signum)
    with caplog.at_level(logging.INFO, logger="gtpo_megatron"):
        _run(tmp_path / "cut", engine=engine, policy=policy)
    assert [p.name for p in list_checkpoints(tmp_path / "cut" / "checkpoints")] == [f"step_{saved:06d}"]
    assert len(policy.train_batches) == updates and engine.events.count("synced") == syncs
    assert _steps_logged(tmp_path / "cut") == list(range(1, saved + 1))
    assert engine.seconds < 5, "the signal did not interrupt the generation"
    if saved == 2:
        assert f"{signal.Signals(signum).name}: step 3 aborted; step 2 saved; resume with resume=true" in caplog.text
    else:
        assert f"{signal.Signals(signum).name}: saved step 3 and stopped" in caplog.text
    full = _run(tmp_path / "full")
    state = json.loads((tmp_path / "cut" / "checkpoints" / f"step_{saved:06d}" / "state.json").read_text())
    resumed = _run(tmp_path / "cut", "resume=true")
    assert state["step"] == saved and state["initial_entropy_steps"] == saved  # not the aborted step's measurement
    prompts = lambda trainer: [call[0] for call in trainer.collector.engine.calls]  # noqa: E731
    assert prompts(resumed) == prompts(full)[saved:]  # the loader position of the saved step
    assert _steps_logged(tmp_path / "cut") == [1, 2, 3, 4]


def test_sigterm_in_step_1_saves_nothing_and_a_saved_step_is_not_saved_twice(tmp_path):
    _run(tmp_path / "first", engine=_SignalEngine(1, signal.SIGTERM))
    assert list_checkpoints(tmp_path / "first" / "checkpoints") == []
    policy = FakePolicy()
    trainer = make_trainer(
        tmp_path / "again", "checkpoint.every_n_steps=2", engine=_SignalEngine(3, signal.SIGTERM), policy=policy
    )
    trainer.run()
    assert [os.path.basename(p) for p in policy.saved] == ["step_000002"]  # saved by every_n_steps, not again


def test_signals_are_off_when_disabled_and_handlers_are_restored(tmp_path):
    before = signal.getsignal(signal.SIGUSR1)
    requests = StopRequests(on_sigterm=False, on_sigusr1=True)
    with requests.installed():
        assert signal.getsignal(signal.SIGTERM) != requests._on_abort
        os.kill(os.getpid(), signal.SIGUSR1)
        assert requests.save_requested and not requests.abort_requested and requests.describe() == "SIGUSR1"
    assert signal.getsignal(signal.SIGUSR1) is before
    requests = StopRequests(on_sigterm=True, on_sigusr1=False)
    requests.abort_requested = True  # a SIGTERM arrived before the interruptible block started
    with pytest.raises(StepInterrupted), requests.interruptible():
        pytest.fail("the block must not start")


@pytest.mark.parametrize("signum", ABORT_SIGNALS, ids=lambda s: s.name)
def test_a_signal_on_another_thread_or_before_a_wait_ends_the_wait(signum):
    """The race of a lost stop request: a signal handled by another thread (the main thread sleeps on, its handler
    pending) or one that lands before the wait starts. A 60 s wait that is not left fails the test."""
    requests, never, waiting = StopRequests(on_sigterm=True, on_sigusr1=False), threading.Event(), threading.Event()

    def wait_slice(seconds):
        waiting.set()
        return never.wait(seconds)

    def signal_this_thread():
        waiting.wait()
        signal.pthread_kill(threading.get_ident(), signum)

    with requests.installed():
        sender = threading.Thread(target=signal_this_thread)
        sender.start()
        with pytest.raises(StepInterrupted):
            wait_until(wait_slice, 60.0, requests)
        sender.join()
        assert requests.describe() == signum.name
        never.set()
        with pytest.raises(StepInterrupted):  # the request stays: the next wait is not entered
            wait_until(never.wait, 60.0, requests)


class _SignalWhileLoading(FakePolicy):
    """Sends SIGUSR1 to this process while it loads the checkpoint (a start-up phase that takes minutes at scale)."""

    def load_checkpoint(self, path):
        os.kill(os.getpid(), signal.SIGUSR1)
        return super().load_checkpoint(path)


def test_sigusr1_during_start_up_is_honoured_at_the_first_step_boundary(tmp_path, caplog):
    _run(tmp_path / "resumed", "trainer.max_steps=1")
    hold_stop_signals()  # gtpo-train's first call
    try:
        os.kill(os.getpid(), signal.SIGUSR1)  # while the components are built: held, the process lives on
        with caplog.at_level(logging.INFO):
            _run(tmp_path / "fresh")
        _run(tmp_path / "resumed", "resume=true", policy=_SignalWhileLoading())  # sent during the checkpoint load
    finally:
        release_stop_signals()
    assert _steps_logged(tmp_path / "fresh") == [1] and list_checkpoints(tmp_path / "fresh" / "checkpoints")
    assert _steps_logged(tmp_path / "resumed") == [1, 2]  # resumed after step 1, saved step 2 and stopped
    assert [p.name for p in list_checkpoints(tmp_path / "resumed" / "checkpoints")][-1] == "step_000002"
    assert "SIGUSR1 received during start-up: saving at the first step boundary" in caplog.text
    assert "SIGUSR1: saved step 1 and stopped" in caplog.text
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
    assert signal.SIGUSR1 not in signal.pthread_sigmask(signal.SIG_BLOCK, set())
