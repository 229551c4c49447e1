"""An engine leader's guard around its engine: time limits, a name in every error, and no use after a failed update.

``GuardedEngine`` wraps a ``RolloutEngine`` for the trainer: every generation and weight update runs under a
``rollout.timeout_s`` watchdog (daemon threads), and a hung or dead engine stops the job with a ``RuntimeError``
naming the engine and its ranks (an ``EngineFailure``); an update that fails half-way marks the engine unusable.
With a ``HealthCheck`` (``rollout.fault_tolerance``) every wait also probes the engine's processes each
``health_check_interval_s``, so a dead or stopped engine is found before ``timeout_s``. The collective path's
worker calls run in the background (:meth:`~GuardedEngine.start_receive`) while this process sends;
:func:`load_in_flight` wraps any path's load in a pause (partial rollouts). ``close``
waits ``CLOSE_TIMEOUT_S`` at most; :func:`close_all` runs every teardown step, keeping the job's own error first.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gtpo_megatron.plan.engines import EnginePlacement
from gtpo_megatron.preemption import StepInterrupted, wait_until
from gtpo_megatron.rollout.engine import NamedTensor, RolloutEngine, SamplingConfig
from gtpo_megatron.rollout.types import PromptCompletions

if TYPE_CHECKING:
    from gtpo_megatron.config import RolloutConfig

logger = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 60.0
"""Longest wait for an engine to shut down."""


class EngineCall:
    """One engine call running in a daemon thread; :meth:`result` waits for it with a time limit."""

    def __init__(self, fn: Callable[[], Any], what: str) -> None:
        self.what = what
        self._value: Any = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(fn,), name=f"gtpo-{what}", daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._value = fn()
        except BaseException as err:  # handed to the waiting thread
            self._error = err
        finally:
            self._done.set()

    def finished(self, timeout_s: float) -> bool:
        """Whether the call ended within ``timeout_s`` (returned or raised); leaves on an abort signal as below."""
        return wait_until(self._done.wait, timeout_s)

    def result(self, timeout_s: float) -> Any:
        """The call's value; ``TimeoutError`` after ``timeout_s`` (the daemon is left behind), or the call's error.

        Waits in slices (``preemption.wait_until``): an abort signal inside ``StopRequests.interruptible`` leaves it.
        """
        if not wait_until(self._done.wait, timeout_s):
            raise TimeoutError(f"{self.what} did not finish within {timeout_s:g} s")
        if self._error is not None:
            raise self._error
        return self._value


class EngineFailure(RuntimeError):
    """An engine call failed, timed out or the engine failed its health check (the message names the engine)."""


@dataclass(frozen=True, slots=True)
class HealthCheck:
    """Probe an engine (``check_health``) every ``interval_s`` while a call runs; a probe may take ``timeout_s``.

    ``first_wait_s``: from ``started_at_s`` (``time.monotonic``), a probe that does not answer in time is tolerated
    (a cold start); a probe that raises (a dead or stopped process) counts at once.
    """

    interval_s: float
    timeout_s: float
    first_wait_s: float
    started_at_s: float

    @classmethod
    def from_config(cls, rollout: RolloutConfig) -> HealthCheck:
        """The ``rollout.health_check_*`` settings, the first wait starting now."""
        return cls(rollout.health_check_interval_s, rollout.health_check_timeout_s,
                   rollout.health_check_first_wait_s, time.monotonic())  # fmt: skip

    def watch(self, call: EngineCall, probe: Callable[[], None], timeout_s: float) -> Any:
        """``call.result`` within ``timeout_s``, probing between waits; raises ``TimeoutError`` or the probe's error."""
        deadline = time.monotonic() + timeout_s
        while not call.finished(max(min(self.interval_s, deadline - time.monotonic()), 0.0)):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{call.what} did not finish within {timeout_s:g} s")
            check = EngineCall(probe, "health check")
            if not check.finished(self.timeout_s):
                if time.monotonic() - self.started_at_s >= self.first_wait_s:
                    raise TimeoutError(f"the health check did not answer within {self.timeout_s:g} s (hung engine)")
                continue
            check.result(0.0)  # a dead or stopped engine raises here
        return call.result(0.0)


class GuardedEngine:
    """``engine`` with a ``timeout_s`` watchdog, the name of its ``placement`` in errors and an unusable state.

    ``health``: probe the engine while waiting (``rollout.fault_tolerance``), else None.
    """

    def __init__(
        self, engine: RolloutEngine, *, placement: EnginePlacement, timeout_s: float, health: HealthCheck | None = None
    ) -> None:
        self.engine = engine
        self.placement = placement
        self.timeout_s = timeout_s
        self.health = health
        self.unusable: str | None = None

    @property
    def name(self) -> str:
        """The engine's description (``EnginePlacement.describe``)."""
        return self.placement.describe()

    def _guarded(self, fn: Callable[[], Any], what: str, *, breaks_weights: bool) -> Any:
        return self.wait(EngineCall(fn, what), breaks_weights=breaks_weights)

    def wait(self, call: EngineCall, *, breaks_weights: bool = True) -> Any:
        """Wait for a call (``timeout_s`` at most); a failure marks the engine unusable and raises, naming it."""
        probe = getattr(self.engine, "check_health", None)
        try:
            if self.health is None or probe is None:
                return call.result(self.timeout_s)
            return self.health.watch(call, probe, self.timeout_s)
        except StepInterrupted:  # a stop signal left the wait: not the engine's failure
            raise
        except BaseException as err:
            if breaks_weights:
                self.unusable = f"{call.what} failed: {err}"
            raise EngineFailure(
                f"{self.name}: {call.what} failed ({type(err).__name__}: {err}); rollout.timeout_s={self.timeout_s:g}"
                " bounds every generation and weight update." + (" Stopping the job." if self.health is None else "")
            ) from err

    def _check_usable(self) -> None:
        if self.unusable is not None:
            raise EngineFailure(f"{self.name} is unusable since a weight update failed half-way ({self.unusable})")

    # ------------------------------------------------------------------------------------------- RolloutEngine
    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingConfig,
        prompt_indices: Sequence[int] | None = None,
    ) -> list[PromptCompletions]:
        """``engine.generate`` under the watchdog (see ``RolloutEngine.generate``)."""
        self._check_usable()
        call = lambda: self.engine.generate(prompt_ids, n, sampling, prompt_indices=prompt_indices)  # noqa: E731
        return self._guarded(call, "generation", breaks_weights=False)

    def update_weights(self, named_tensors: Iterable[NamedTensor]) -> None:
        """``engine.update_weights`` (one bucket)."""
        self.begin_weight_update()
        self.load_weight_bucket(list(named_tensors))
        self.finish_weight_update()

    def begin_weight_update(self) -> None:
        """``engine.begin_weight_update``."""
        self.engine.begin_weight_update()

    def load_weight_bucket(self, bucket: Sequence[NamedTensor]) -> None:
        """``engine.load_weight_bucket`` (staging only: a failure leaves the served weights untouched)."""
        self.engine.load_weight_bucket(bucket)

    def finish_weight_update(self) -> None:
        """``engine.finish_weight_update`` under the watchdog; a failed reload marks the engine unusable."""
        self._guarded(self.engine.finish_weight_update, "weight update (files)", breaks_weights=True)

    def pause(self) -> None:
        """``engine.pause`` (partial rollouts: its requests frozen with their KV) under the watchdog."""
        self._check_usable()
        self._guarded(self.engine.pause, "pausing for an in-flight update", breaks_weights=False)

    def resume(self, version: int | None) -> None:
        """``engine.resume(version)`` under the watchdog; a failure marks the engine unusable."""
        self._guarded(lambda: self.engine.resume(version), "resuming after an in-flight update", breaks_weights=True)

    def sleep(self) -> None:
        """``engine.sleep`` (skipped on an unusable engine: a lost one may be dead)."""
        if self.unusable is None:
            self.engine.sleep()

    def wake_up(self) -> None:
        """``engine.wake_up`` (skipped on an unusable engine)."""
        if self.unusable is None:
            self.engine.wake_up()

    def close(self) -> None:
        """``engine.close``, given at most ``CLOSE_TIMEOUT_S`` (a hung engine must not keep the job from exiting).

        Raises:
            RuntimeError: naming the engine, when its close raised.
        """
        try:
            EngineCall(self.engine.close, "closing").result(min(self.timeout_s, CLOSE_TIMEOUT_S))
        except TimeoutError:
            logger.warning("%s did not shut down within %g s; leaving it behind", self.name, CLOSE_TIMEOUT_S)
        except Exception as err:
            raise RuntimeError(f"{self.name}: closing failed ({type(err).__name__}: {err})") from err

    def load_adapter(self, folder: str) -> int:
        """``engine.load_adapter`` under the watchdog (``rollout.lora_sync: adapter``); a failure marks it unusable."""
        self._check_usable()
        return self._guarded(lambda: self.engine.load_adapter(folder), "adapter update", breaks_weights=True)

    # ------------------------------------------------------------------------------------ collective weight path
    def start_join(self, spec: dict, worker_offset: int) -> EngineCall:
        """Start the workers' ``join_weight_group`` in the background; :meth:`wait` for it."""
        return EngineCall(lambda: self.engine.join_weight_group(spec, worker_offset), "joining the weight group")

    def start_receive(self) -> EngineCall:
        """Start the workers' ``receive_weights`` for one update in the background; :meth:`wait` for it."""
        self._check_usable()
        return EngineCall(self.engine.receive_weights, "weight update (collective)")


def load_in_flight(engine: GuardedEngine | None, version: int, load: Callable[[], dict]) -> dict[str, float]:
    """Pause ``engine`` (keeping its requests and KV), ``load``, label the weights ``version`` and resume.

    ``engine`` None or unusable (lost, under fault tolerance): ``load`` alone, then the label if the load made it
    whole again. Every rank's ``load`` runs whatever the pause did: a dead engine fails its part of it, which that
    path reports (its side channel, fault tolerance). A failed load resumes a usable engine unlabelled and raises;
    an unusable one is not resumed (it is replaced, or the job stops); a failed resume leaves the engine unusable
    (its next batch fails, naming it). Returns ``load``'s value. Why the kept KV and the recorded versions are
    exact: docs/training.md, "Partial rollouts" (the order: ``rollout/pipeline.py``).
    """
    paused = engine is not None and engine.unusable is None
    if paused:
        try:
            engine.pause()
        except EngineFailure as err:
            logger.warning("%s did not pause for the in-flight update (%s); loading regardless", engine.name, err)
    try:
        metrics = load()
    except BaseException:
        if paused and engine.unusable is None:
            resume_quietly(engine, None)
        raise
    if engine is not None and engine.unusable is None:  # also one fault tolerance made whole again in ``load``
        resume_quietly(engine, version)
    return metrics


def resume_quietly(engine: GuardedEngine, version: int | None) -> None:
    """``engine.resume(version)``; a failure is logged (the guard marked the engine unusable)."""
    try:
        engine.resume(version)
    except EngineFailure as err:
        logger.warning("%s did not resume after the in-flight update (%s)", engine.name, err)


def close_all(steps: Sequence[tuple[str, Callable[[], object]]]) -> None:
    """Run every ``(what, close)`` teardown step in order, whichever fail.

    While an error leaves (``finally``/``except``), failures are logged and added to its notes (its traceback
    comes first); otherwise the first failure is raised once every step ran, the others in its notes.
    """
    original = sys.exception()
    failures: list[Exception] = []
    for what, close in steps:
        try:
            close()
        except Exception as err:
            logger.error("closing %s failed: %s: %s", what, type(err).__name__, err)
            err.add_note(f"while closing {what}")
            failures.append(err)
    if not failures:
        return
    notes = [f"teardown: {failure!r} ({failure.__notes__[-1]})" for failure in failures]
    if original is not None:
        for note in notes:
            original.add_note(note)
        return
    for note in notes[1:]:
        failures[0].add_note(note)
    raise failures[0]
