"""Async rollouts (``rollout/pipeline.py``) in the loop over the fakes: the schedule, staleness, the prompt stream,
faults and the checkpointed in-flight batches.

The async schedule (k = 1): batches 1 and 2 with the start weights, then one push and one batch per step, each push
between two generations; batch j trains with staleness min(k, j - 1). The prompts and request seeds of every step
are those of a sync run, so with the fake engine (completions depend on the seeds only) every trained batch is too.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading

import pytest
import torch

from gtpo_megatron.config import load_config
from gtpo_megatron.run_dir import list_checkpoints
from tests.trainer.fakes import FakePolicy, SeededFakeEngine, make_trainer, one_rank_process_group

one_rank_world = pytest.fixture(scope="module", autouse=True)(one_rank_process_group)
ASYNC = ("rollout.placement=separate", "rollout.mode=async", "checkpoint.every_n_steps=0")
HANG_BOUND_S = 300.0
"""Longest a hung fake generation waits for its test to release it."""


class _LoggingEngine(SeededFakeEngine):
    """Logs ``gen<step>`` after each generation and ``push`` after each weight update; fails or hangs at a step.

    A hung generation waits for ``release`` (at most ``HANG_BOUND_S``), set by the test once it saw the timeout.
    """

    def __init__(self, *, fail_at=None, hang_at=None):
        super().__init__()
        self.log, self.fail_at, self.hang_at = [], fail_at, hang_at
        self.threads = set()
        self.release = threading.Event()

    def generate(self, prompt_ids, n, sampling, prompt_indices=None):
        step = sampling.seed // 1000
        self.threads.add(threading.current_thread().name)
        if step == self.fail_at:
            raise RuntimeError("engine core died")
        if step == self.hang_at:
            self.release.wait(HANG_BOUND_S)
        out = super().generate(prompt_ids, n, sampling, prompt_indices)
        self.log.append(f"gen{step}")
        return out

    def finish_weight_update(self):
        super().finish_weight_update()
        self.log.append("push")


def _run(tmp_path, *overrides, engine=None):
    trainer = make_trainer(tmp_path, *overrides, engine=engine or _LoggingEngine(), policy=FakePolicy())
    trainer.run()
    path = tmp_path / "metrics.jsonl"
    return trainer, [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _trained(trainer):
    return [(b.input_ids, b.advantages, b.token_weights) for b, _, _ in trainer.policy.train_batches]


@pytest.mark.parametrize(("k", "staleness"), [(1, [0, 1, 1, 1]), (2, [0, 1, 2, 2])])
def test_schedule_staleness_and_the_prompt_stream_of_a_sync_run(tmp_path, k, staleness):
    sync, sync_records = _run(tmp_path / "sync", "rollout.placement=separate")
    run, records = _run(tmp_path / "async", *ASYNC, f"rollout.max_staleness={k}")
    assert [r["async/staleness_mean"] for r in records] == staleness
    assert [r["async/staleness_max"] for r in records] == staleness
    assert "async/staleness_mean" not in sync_records[0]
    # every push lands between two generations and the next batch follows it; none after the last batch: 4-1-k
    assert run.collector.engine.log.count("push") == 3 - k
    if k == 1:
        assert run.collector.engine.log == ["gen1", "gen2", "push", "gen3", "push", "gen4"]
    assert run.collector.engine.threads == {"gtpo-async-rollout"}
    calls = lambda t: [(c[0], c[2]) for c in t.collector.engine.calls]  # noqa: E731 - prompts and sampling
    assert calls(run) == calls(sync)  # the same prompts and request seeds, step by step
    for mine, theirs in zip(_trained(run), _trained(sync), strict=True):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs))
    assert [r["reward/mean"] for r in records] == [r["reward/mean"] for r in sync_records]
    assert all(r["async/rollout_wait_s"] >= 0 and 0 <= r["async/engine_busy_frac"] <= 1 for r in records)
    assert [r["async/requests_in_flight"] for r in records] == [2 * 4 * min(k, 4 - s) for s in range(1, 5)]


class _LoggingPolicy(FakePolicy):
    """Logs ``train<step>`` and ``trained<step>`` around each update into ``log``; update ``hold_at`` lasts until
    ``until`` is set (bounded: a run that never sets it fails its order assertions instead of hanging)."""

    def __init__(self, log, *, hold_at=None, until=None):
        super().__init__()
        self.log, self.hold_at, self.until, self.started = log, hold_at, until, threading.Event()

    def train_step(self, batch, loss):
        step = len(self.train_batches) + 1
        self.log.append(f"train{step}")
        if step == self.hold_at:
            self.started.set()
            self.until.wait(30)
        metrics = super().train_step(batch, loss)
        self.log.append(f"trained{step}")
        return metrics


class _HeldEngine(_LoggingEngine):
    """Generation ``held`` starts only once ``policy.started`` is set; ``done`` is set after generation ``last``."""

    def __init__(self, *, held, last):
        super().__init__()
        self.held, self.last, self.done, self.policy = held, last, threading.Event(), None

    def generate(self, prompt_ids, n, sampling, prompt_indices=None):
        if sampling.seed // 1000 == self.held:
            self.policy.started.wait(30)
        out = super().generate(prompt_ids, n, sampling, prompt_indices)
        if sampling.seed // 1000 == self.last:
            self.done.set()
        return out


def test_k2_engines_sample_two_batches_and_load_weights_within_one_training_step(tmp_path):
    # k = 2: the queue is gen1 gen2 gen3 | weights 1 | gen4. Batch 3 is held until update 2 starts, and update 2
    # lasts until batch 4 is sampled: only a pipeline that queues the weights (no drain after update 1) gets there.
    engine = _HeldEngine(held=3, last=4)
    policy = engine.policy = _LoggingPolicy(engine.log, hold_at=2, until=engine.done)
    trainer = make_trainer(tmp_path, *ASYNC, "rollout.max_staleness=2", engine=engine, policy=policy)
    trainer.run()
    trainer.close()
    log = engine.log
    assert log.index("trained1") < log.index("train2") < log.index("gen3") < log.index("push") < log.index("gen4")
    assert log.index("gen4") < log.index("trained2")
    assert log.count("push") == 1 and log[-2:] == ["train4", "trained4"]


class _SignalAfterUpdate(FakePolicy):
    """Sends SIGTERM at the end of update ``at`` (the step then skips its weight push and saves)."""

    def __init__(self, at: int):
        super().__init__()
        self.at = at

    def train_step(self, batch, loss):
        metrics = super().train_step(batch, loss)
        if len(self.train_batches) == self.at:
            os.kill(os.getpid(), signal.SIGTERM)
        return metrics


class _SlowEngine(_LoggingEngine):
    """Generation ``step`` lasts until ``release`` is set (its ``gen<step>`` is logged after it)."""

    def __init__(self, step: int):
        super().__init__()
        self.slow_step, self.release = step, threading.Event()

    def generate(self, prompt_ids, n, sampling, prompt_indices=None):
        if sampling.seed // 1000 == self.slow_step:
            self.release.wait(300)
        return super().generate(prompt_ids, n, sampling, prompt_indices)


class _SignalEngine(_SlowEngine):
    """SIGTERM at the start of the slow generation, so a trainer that waited for it cannot finish first."""

    def generate(self, prompt_ids, n, sampling, prompt_indices=None):
        if sampling.seed // 1000 == self.slow_step:
            os.kill(os.getpid(), signal.SIGTERM)
        return super().generate(prompt_ids, n, sampling, prompt_indices)


def test_sigterm_while_waiting_for_the_first_batch_aborts_step_1(tmp_path, caplog):
    engine = _SignalEngine(1)
    with caplog.at_level(logging.INFO, logger="gtpo_megatron"):
        _, records = _run(tmp_path, *ASYNC, engine=engine)
    assert engine.log == [], "SIGTERM did not leave the wait for the batch"  # the generation is still running
    engine.release.set()
    assert records == [] and list_checkpoints(tmp_path / "checkpoints") == []
    assert "SIGTERM: step 1 aborted; no step completed, nothing saved" in caplog.text


def test_sigterm_after_an_update_saves_the_step_with_its_batches_in_flight_and_a_resume_samples_them(tmp_path):
    full, _ = _run(tmp_path / "full", *ASYNC)
    policy = _SignalAfterUpdate(at=2)
    trainer = make_trainer(tmp_path / "cut", *ASYNC, engine=_SlowEngine(3), policy=policy)
    trainer.run()
    assert "gen3" not in trainer.collector.engine.log, "the trainer waited for a batch it does not train"
    trainer.collector.engine.release.set()
    trainer.close()
    assert [p.name for p in list_checkpoints(tmp_path / "cut" / "checkpoints")] == ["step_000002"]
    state = json.loads((tmp_path / "cut" / "checkpoints" / "step_000002" / "state.json").read_text())
    assert state["rollout_in_flight"] == [3]  # sampled with step 1's weights, never trained
    assert state["loader"] == full.loader.fork().state_dict() | {"position": 2 * 2}  # 2 prompts a step, 2 steps
    resumed, records = _run(tmp_path / "cut", *ASYNC, "resume=true")
    prompts = lambda t: [c[0] for c in t.collector.engine.calls]  # noqa: E731
    assert prompts(resumed) == prompts(full)[2:]  # steps 3 and 4 sampled again: no prompt lost or repeated
    assert resumed.collector.engine.log[:3] == ["push", "gen3", "gen4"]  # the resumed weights first
    assert [r["step"] for r in records] == [1, 2, 3, 4]


@pytest.mark.parametrize(
    ("failure", "timeout_s", "match"),
    [
        ("fail_at", 300, r"the async rollout of step 2 failed \(RuntimeError: engine core died\)"),
        ("hang_at", 3, r"the async rollout of step 2 did not finish within rollout.timeout_s=3 s"),
    ],
)
def test_an_engine_that_dies_or_hangs_stops_the_job_with_a_clear_error(tmp_path, failure, timeout_s, match):
    """Step 1's batch arrives, then step 2's fails or hangs: the error names step 2.

    The hang's timeout is one that step 1's batch meets on a loaded machine; a failure raises at once, so its timeout
    only has to be long.
    """
    engine = _LoggingEngine(**{failure: 2})
    trainer = make_trainer(tmp_path, *ASYNC, f"rollout.timeout_s={timeout_s}", engine=engine, policy=FakePolicy())
    try:
        with pytest.raises(RuntimeError, match=match):
            trainer.run()
        assert "gen1" in engine.log and "gen2" not in engine.log, engine.log
    finally:
        engine.release.set()
        trainer.close()


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["rollout.mode=async"], r"rollout.mode/rollout.placement=\('async', 'colocated'\): async rollouts"),
        (["rollout.placement=separate", "rollout.mode=async", "rollout.max_staleness=0"],
         r"rollout.max_staleness=0: must be >= 1"),
    ],
)  # fmt: skip
def test_bad_async_settings_are_refused(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_config(None, ["model=builtin:tiny-qwen2", "output_dir=/tmp/x", *overrides])


def test_a_lag_above_one_step_without_a_clipped_importance_weight_is_refused():
    cfg = load_config(None, ["model=builtin:tiny-qwen2", "output_dir=/tmp/x", *ASYNC, "rollout.max_staleness=2"])
    with pytest.raises(ValueError, match=r"algorithm.off_policy_correction/rollout.max_staleness=\('none', 2\)"):
        cfg.validate(1)
    fixed = ["model=builtin:tiny-qwen2", "output_dir=/tmp/x", *ASYNC, "rollout.max_staleness=2"]
    load_config(None, [*fixed, "algorithm.off_policy_correction=tis"]).validate(1)
    load_config(None, ["model=builtin:tiny-qwen2", "output_dir=/tmp/x", *ASYNC]).validate(1)  # k = 1: allowed


def test_async_with_dynamic_sampling_is_refused():
    cfg = load_config(
        None, ["model=builtin:tiny-qwen2", "output_dir=/tmp/x", *ASYNC, "algorithm.dynamic_sampling=true"]
    )
    with pytest.raises(ValueError, match=r"rollout.mode/algorithm.dynamic_sampling=\('async', True\)"):
        cfg.validate(1)


class _AffinityEngine(SeededFakeEngine):
    """Records the CPU cores of the thread each generation runs on."""

    def __init__(self):
        super().__init__()
        self.cores = []

    def generate(self, prompt_ids, n, sampling, prompt_indices=None):
        self.cores.append(os.sched_getaffinity(0))
        return super().generate(prompt_ids, n, sampling, prompt_indices)


def test_the_async_worker_samples_on_the_collectors_cores_and_the_trainer_keeps_its_own(tmp_path):
    cores = os.sched_getaffinity(0)
    engine = _AffinityEngine()
    trainer = make_trainer(tmp_path, *ASYNC, "trainer.max_steps=2", engine=engine, policy=FakePolicy())
    trainer.collector.cores = (max(cores),)  # separate engines on CPU: build_rollout.bind_training_rank's engine cores
    trainer.rollouts.close()
    trainer.rollouts = type(trainer.rollouts)(trainer.cfg, collector=trainer.collector, loader=trainer.loader,
                                              exchange=trainer.rollouts.exchange)  # fmt: skip
    trainer.run()
    trainer.close()
    assert engine.cores == [{max(cores)}] * 2 and os.sched_getaffinity(0) == cores
