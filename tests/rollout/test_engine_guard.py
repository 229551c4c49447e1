"""``GuardedEngine``: a hung or dead engine stops the step with its name and ranks, a half-applied update is final."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from gtpo_megatron.plan.engines import EnginePlacement
from gtpo_megatron.preemption import StepInterrupted, StopRequests
from gtpo_megatron.rollout.engine import SamplingConfig
from gtpo_megatron.rollout.engine_guard import EngineCall, EngineFailure, GuardedEngine, HealthCheck, load_in_flight
from tests.trainer.fakes import FakeEngine

PLACEMENT = EnginePlacement(index=1, num_engines=2, leader_rank=2, ranks=(2, 3), devices=(2, 3))
NAME = r"engine 1 of 2 \(leader rank 2, ranks \[2, 3\], GPUs \[2, 3\]\)"


class _Stuck(FakeEngine):
    """Generation hangs until released; the files reload fails."""

    def __init__(self):
        super().__init__()
        self.release = threading.Event()

    def generate(self, prompt_ids, n, sampling, prompt_indices=None):
        self.release.wait(30)
        return super().generate(prompt_ids, n, sampling, prompt_indices)

    def finish_weight_update(self):
        raise OSError("reload failed: disk full")


def test_a_hung_generation_stops_within_the_timeout_naming_the_engine():
    engine = _Stuck()
    guarded = GuardedEngine(engine, placement=PLACEMENT, timeout_s=0.2)
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match=NAME + r": generation failed \(TimeoutError: generation did not finish "
                                                  r"within 0.2 s\); rollout.timeout_s=0.2"):  # fmt: skip
        guarded.generate([[1, 2]], 2, SamplingConfig(seed=3))
    assert time.perf_counter() - start < 2
    assert guarded.unusable is None  # a generation error leaves the weights alone
    engine.release.set()
    out = guarded.generate([[1, 2]], 2, SamplingConfig(seed=3), prompt_indices=[5])
    assert len(out[0].completions) == 2 and [5] in engine.prompt_indices  # the stuck call also ends now


def test_a_stop_signal_on_another_thread_leaves_a_hung_generation_and_keeps_the_engine():
    """Another thread takes the SIGTERM; the main thread, waiting for the engine, still leaves within a slice."""
    engine = _Stuck()
    guarded, requests = (
        GuardedEngine(engine, placement=PLACEMENT, timeout_s=60.0),
        StopRequests(on_sigterm=True, on_sigusr1=False),
    )
    with requests.installed(), pytest.raises(StepInterrupted), requests.interruptible():
        threading.Timer(0.2, lambda: signal.pthread_kill(threading.get_ident(), signal.SIGTERM)).start()
        guarded.generate([[1, 2]], 2, SamplingConfig(seed=3))
    engine.release.set()
    assert guarded.unusable is None and len(guarded.generate([[1]], 1, SamplingConfig())) == 1


def test_a_failed_reload_makes_the_engine_unusable():
    guarded = GuardedEngine(_Stuck(), placement=PLACEMENT, timeout_s=1.0)
    guarded.begin_weight_update()
    guarded.load_weight_bucket([("w", None)])
    with pytest.raises(RuntimeError, match=NAME + r": weight update \(files\) failed \(OSError: reload failed"):
        guarded.finish_weight_update()
    with pytest.raises(RuntimeError, match=NAME + " is unusable since a weight update failed half-way"):
        guarded.generate([[1]], 1, SamplingConfig())
    with pytest.raises(RuntimeError, match="is unusable"):
        guarded.start_receive()


def test_engine_call_returns_or_reraises():
    assert EngineCall(lambda: 7, "seven").result(1.0) == 7
    with pytest.raises(ZeroDivisionError):
        EngineCall(lambda: 1 / 0, "division").result(1.0)
    with pytest.raises(TimeoutError, match="nap did not finish within 0.05 s"):
        EngineCall(lambda: time.sleep(1), "nap").result(0.05)


def test_closing_a_hung_engine_does_not_hang(monkeypatch, caplog):
    monkeypatch.setattr("gtpo_megatron.rollout.engine_guard.CLOSE_TIMEOUT_S", 0.1)
    engine = _Stuck()
    engine.close = lambda: engine.release.wait(30)
    start = time.perf_counter()
    with caplog.at_level("WARNING"):
        GuardedEngine(engine, placement=PLACEMENT, timeout_s=5.0).close()
    assert time.perf_counter() - start < 2 and "did not shut down within 0.1 s" in caplog.text
    engine.release.set()


class _Probed(_Stuck):
    """A hung generation whose health check reports a stopped process, or (``silent``) never answers."""

    def __init__(self, silent: bool = False):
        super().__init__()
        self.silent, self.probes = silent, 0

    def check_health(self):
        self.probes += 1
        if self.silent:
            self.release.wait(30)
        raise RuntimeError("engine process 4242 (VLLM::EngineCore) is stopped")


def _health(first_wait_s: float = 0.0) -> HealthCheck:
    return HealthCheck(interval_s=0.05, timeout_s=0.1, first_wait_s=first_wait_s, started_at_s=time.monotonic())


def test_a_health_check_finds_a_stopped_engine_long_before_the_timeout():
    engine = _Probed()
    guarded = GuardedEngine(engine, placement=PLACEMENT, timeout_s=30.0, health=_health())
    with pytest.raises(EngineFailure, match=NAME + r": generation failed \(RuntimeError: .* is stopped\)"):
        guarded.generate([[1, 2]], 1, SamplingConfig())
    assert engine.probes == 1
    engine.release.set()


def test_a_silent_health_check_counts_only_after_the_first_wait():
    engine = _Probed(silent=True)
    guarded = GuardedEngine(engine, placement=PLACEMENT, timeout_s=0.6, health=_health(first_wait_s=30.0))
    with pytest.raises(EngineFailure, match=r"generation did not finish within 0.6 s"):  # tolerated: a cold start
        guarded.generate([[1, 2]], 1, SamplingConfig())
    assert engine.probes >= 2
    guarded.health = _health(first_wait_s=0.0)
    with pytest.raises(EngineFailure, match=r"the health check did not answer within 0.1 s \(hung engine\)"):
        guarded.generate([[1, 2]], 1, SamplingConfig())
    engine.release.set()


def test_a_healthy_engine_answers_through_the_health_checks():
    engine = FakeEngine()
    engine.check_health = lambda: None
    guarded = GuardedEngine(engine, placement=PLACEMENT, timeout_s=5.0, health=_health())
    assert len(guarded.generate([[1, 2]], 2, SamplingConfig())[0].completions) == 2


class _Pausable(FakeEngine):
    """Logs pauses, loads and resumes; ``dead``: pausing and resuming fail (its processes are gone)."""

    def __init__(self, dead=False):
        super().__init__()
        self.log, self.dead = [], dead

    def pause(self):
        if self.dead:
            raise RuntimeError("engine core died")
        self.log.append("pause")

    def resume(self, version):
        if self.dead:
            raise RuntimeError("engine core died")
        self.log.append(f"resume{version}")


@pytest.mark.parametrize(
    ("start_unusable", "dead", "load_fails", "load_breaks", "load_mends", "log"),
    [
        (False, False, False, False, False, ["pause", "load", "resume3"]),
        (False, False, True, False, False, ["pause", "load", "resumeNone"]),  # resumed unlabelled, then raised
        (False, False, True, True, False, ["pause", "load"]),  # the failed receive broke it: not resumed
        (True, False, False, False, False, ["load"]),  # lost (fault tolerance): not paused, not resumed
        (True, False, False, False, True, ["load", "resume3"]),  # made whole by the load: labelled
        (False, True, False, False, False, ["load"]),  # dead: the pause fails, every rank's load still runs
    ],
)
def test_load_in_flight_pauses_loads_and_labels_only_engines_it_can(
    start_unusable, dead, load_fails, load_breaks, load_mends, log
):
    engine = _Pausable(dead=dead)
    guarded = GuardedEngine(engine, placement=PLACEMENT, timeout_s=5.0)
    guarded.unusable = "failed: restarting" if start_unusable else None

    def load():
        engine.log.append("load")
        guarded.unusable = "receive failed" if load_breaks else None if load_mends else guarded.unusable
        if load_fails:
            raise RuntimeError("the sync failed")
        return {"sync/bytes": 1.0}

    if load_fails:
        with pytest.raises(RuntimeError, match="the sync failed"):
            load_in_flight(guarded, 3, load)
    else:
        assert load_in_flight(guarded, 3, load) == {"sync/bytes": 1.0}
    assert engine.log == log
    assert (guarded.unusable is not None) == (start_unusable and not load_mends or load_breaks or dead)
