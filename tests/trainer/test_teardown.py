"""Teardown after a failed step: every part is closed even when the engine's close raises, and the step's error is
the one reported (the close failure in its notes)."""

from __future__ import annotations

import time

import pytest

from gtpo_megatron import build, train
from gtpo_megatron.parallel import groups as groups_module
from gtpo_megatron.plan.engines import EnginePlacement
from gtpo_megatron.rollout.engine_guard import GuardedEngine, close_all
from gtpo_megatron.trainer import PhaseTimer
from tests.trainer.fakes import FakeEngine, make_trainer, single_rank_groups

PLACEMENT = EnginePlacement(index=0, num_engines=1, leader_rank=0, ranks=(0,), devices=())
CLOSE_ERROR = "RuntimeError('engine 0 of 1 (leader rank 0, ranks [0]): closing failed (OSError: engine core died)')"


class _DeadCore(FakeEngine):
    def close(self):
        raise OSError("engine core died")


def _failing_run():
    raise ValueError("step 3 failed")


def test_a_failing_engine_close_runs_the_rest_of_the_teardown(tmp_path, monkeypatch):
    engine = GuardedEngine(_DeadCore(), placement=PLACEMENT, timeout_s=5.0)
    trainer = make_trainer(tmp_path, "checkpoint.save_on_sigusr1=false", engine=engine)
    closed = []
    trainer.collector.reward_pool.close = lambda: closed.append("reward pool")
    sink_close = trainer.sink.close
    trainer.sink.close = lambda: (closed.append("sink"), sink_close())
    trainer.run = _failing_run
    monkeypatch.setattr(build, "build_trainer", lambda cfg, groups, timer: trainer)
    started = {}
    monkeypatch.setattr(groups_module, "init_distributed", lambda **kw: started.update(kw) or single_rank_groups())
    monkeypatch.setattr(groups_module, "destroy_distributed", lambda: closed.append("process groups"))
    with pytest.raises(ValueError, match="step 3 failed") as failure:
        train._train(trainer.cfg, PhaseTimer(), started=time.perf_counter())
    assert closed == ["reward pool", "sink", "process groups"]
    assert started["timeout_s"] == trainer.cfg.world_timeout_s > 1800  # the world outlasts the longest engine wait
    assert failure.value.__notes__ == [f"teardown: {CLOSE_ERROR} (while closing the rollout engine)"]


def test_without_an_error_every_step_runs_and_the_first_failure_is_raised():
    ran = []

    def fail(message):
        ran.append(message)
        raise OSError(message)

    steps = [("a", lambda: fail("a broke")), ("b", lambda: ran.append("b")), ("c", lambda: fail("c broke"))]
    with pytest.raises(OSError, match="a broke") as failure:
        close_all(steps)
    assert ran == ["a broke", "b", "c broke"]
    assert failure.value.__notes__ == ["while closing a", "teardown: OSError('c broke') (while closing c)"]
