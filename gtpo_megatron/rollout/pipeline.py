"""Asynchronous rollouts (``rollout.mode: async``): the engines sample the next steps' batches while the policy trains.

With k = ``rollout.max_staleness`` and s steps completed at the start, every rank follows one schedule, and each
engine leader's worker thread runs its queue strictly in order:

    start     queue batches s+1 .. s+1+k                   (the engines hold the weights after step s)
    step t    take(t) -> train -> queue the weights after step t, then batch t+1+k   (while t+1+k <= max_steps)

What the schedule gives (each batch's weights, the time, the drain, checkpoints, partial rollouts): docs/training.md,
"Asynchronous rollouts".
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gtpo_megatron.parallel.collectives import any_rank
from gtpo_megatron.preemption import StepInterrupted, wait_until
from gtpo_megatron.rollout.busy_clock import BusyClock
from gtpo_megatron.rollout.collector import StepRollout, share_step
from gtpo_megatron.rollout.exchange import EngineTally, raise_leader_failures
from gtpo_megatron.rollout.push import FilesWeightSync

if TYPE_CHECKING:
    from collections.abc import Callable

    from gtpo_megatron.config import GTPOConfig
    from gtpo_megatron.data.loader import PromptLoader
    from gtpo_megatron.data.types import Problem
    from gtpo_megatron.preemption import StopRequests
    from gtpo_megatron.rollout.adapter_sync import AdapterWeightSync
    from gtpo_megatron.rollout.collector import RolloutCollector
    from gtpo_megatron.rollout.exchange import ScoredGroup, StepExchange
    from gtpo_megatron.rollout.fault_tolerance import FaultTolerance
    from gtpo_megatron.rollout.push import CollectiveWeightSync, StreamFactory


@dataclass
class _Batch:
    """One step's batch on an engine leader: its prompts, and what the worker made of them."""

    step: int
    problems: list[Problem]
    done: threading.Event = field(default_factory=threading.Event)
    scored: dict[int, ScoredGroup] = field(default_factory=dict)
    tally: EngineTally = field(default_factory=EngineTally)
    error: BaseException | None = None


@dataclass(frozen=True)
class _Weights:
    """The weights after ``step``, queued between two batches: ``load`` puts them into the engine."""

    step: int
    load: Callable[[], object]


class _Worker:
    """A daemon thread that runs a leader's queue of batches and weight loads in order (on the collector's cores).

    ``streaming`` (partial rollouts): each batch is sampled in a thread of its own as soon as it is queued, so the
    engine holds the requests of every queued batch at once and never waits for a batch's longest completion.
    """

    def __init__(self, collector: RolloutCollector, *, streaming: bool = False) -> None:
        self._streaming, self.clock = streaming, BusyClock()
        self._queue: queue.Queue[_Batch | _Weights | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, args=(collector,), name="gtpo-async-rollout", daemon=True)
        self._thread.start()

    def submit(self, item: _Batch | _Weights) -> None:
        self._queue.put(item)

    def close(self) -> None:
        """Stop after the item in progress (the engine's close ends a hung one)."""
        self._queue.put(None)

    def _run(self, collector: RolloutCollector) -> None:
        if collector.cores is not None:  # this thread only: the training rank keeps its cores
            os.sched_setaffinity(0, collector.cores)
        failed_load: tuple[int, BaseException] | None = None  # every later batch fails: its weights are wrong
        while (item := self._queue.get()) is not None:
            if isinstance(item, _Weights):
                try:
                    item.load()
                except BaseException as err:  # reported with the next batch, at its take
                    failed_load = failed_load or (item.step, err)
                continue
            if self._streaming:
                threading.Thread(target=_sample, args=(collector, item, None, self.clock),
                                 name=f"gtpo-batch-{item.step}", daemon=True).start()  # fmt: skip
            else:
                _sample(collector, item, failed_load, self.clock)


def _sample(
    collector: RolloutCollector, batch: _Batch, failed_load: tuple[int, BaseException] | None, clock: BusyClock
) -> None:
    """Sample and score ``batch`` with ``clock`` running; refused after a failed queued load (errors kept for take)."""
    clock.enter()
    try:
        if failed_load is not None:
            step, err = failed_load
            raise RuntimeError(f"loading the weights after step {step} failed ({type(err).__name__}: {err})")
        batch.scored = collector.sample_round(batch.step, 0, batch.problems, batch.tally)
    except BaseException as err:  # handed to the main thread at take or drain
        batch.error = err
    finally:
        clock.leave()
        batch.done.set()


class AsyncRollouts:
    """The schedule of the module docstring on one rank; ``collector`` is this rank's when it leads an engine.

    Args:
        cfg: the run config (``rollout.max_staleness``, ``rollout.timeout_s``, ``trainer.max_steps``).
        collector: this rank's engine leader's collector, else None.
        loader: the trainer's prompt loader (advanced at take, so checkpoints hold the trained position).
        exchange: the step exchange every batch crosses at take (``collector.share_step``).
    """

    def __init__(
        self,
        cfg: GTPOConfig,
        *,
        collector: RolloutCollector | None,
        loader: PromptLoader,
        exchange: StepExchange,
    ) -> None:
        self.cfg, self.collector, self.loader, self.exchange = cfg, collector, loader, exchange
        self.max_staleness = cfg.rollout.max_staleness
        self._versions: dict[int, int] = {}  # queued, not yet taken: step -> the weights' completed steps
        self._batches: dict[int, _Batch] = {}  # the leader's batches of those steps
        self._ahead: PromptLoader | None = None
        self._version = 0
        self._last_take_s = 0.0
        self.partial = cfg.rollout.partial_rollouts  # weights load into the running engine (_update_in_flight)
        self._worker = _Worker(collector, streaming=self.partial) if collector is not None else None
        self._failed_load: tuple[int, BaseException] | None = None

    @property
    def in_flight(self) -> list[int]:
        """Steps whose batches are queued and not trained yet (a resumed run samples them again)."""
        return sorted(self._versions)

    def start(self, completed_steps: int) -> None:
        """Queue the first k+1 batches after ``completed_steps`` (the engines must hold that step's weights)."""
        self._version = completed_steps
        if self._worker is not None and self.partial:  # the engine's tokens carry the start weights' version
            self._update_in_flight(completed_steps, None)
        self._ahead = self.loader.fork()
        self._last_take_s = time.perf_counter()
        for step in range(completed_steps + 1, completed_steps + 2 + self.max_staleness):
            self._submit(step)

    def _submit(self, step: int) -> None:
        if step > self.cfg.trainer.max_steps:
            return
        problems = self._ahead.next_batch()
        self._versions[step] = self._version
        if self._worker is not None:
            self._batches[step] = batch = _Batch(step=step, problems=problems)
            self._worker.submit(batch)

    def take(self, step: int, stop: StopRequests | None) -> StepRollout | None:
        """Step ``step``'s rollout on every rank (None on every rank after a SIGTERM during the wait).

        Adds the ``async/*`` metrics of docs/metrics.md to its stats. Collectives: ``share_step``'s (world).

        Raises:
            RuntimeError: on every rank, naming the engine, when it or the graders failed on this batch (or on a
                queued weight load before it) or it took over ``rollout.timeout_s``.
        """
        problems = self.loader.next_batch()
        version = self._versions.pop(step)
        tally, scored, start = EngineTally(), {}, time.perf_counter()
        if self._worker is not None:
            batch = self._batches.pop(step)
            if batch.problems != problems:  # the look-ahead and the trainer's loader drew different prompts
                raise RuntimeError(f"async rollouts: step {step}'s batch holds other prompts than the loader's")
            try:
                self._raise_failed_load()
                self._wait(batch, stop)
                scored, tally = batch.scored, batch.tally
            except StepInterrupted:
                tally.aborted = 1.0
            except RuntimeError as err:  # shared at the exchange: the other ranks wait there for this batch
                tally.fail(err)
            tally.busy_s = self._worker.clock.read()
        wait_s = time.perf_counter() - start
        engine_index = None if self.collector is None else self.collector.engine_index
        rollout = share_step([scored], [], tally, self.exchange, engine_index=engine_index)
        if rollout is not None:
            rollout.stats.update(self._take_stats(step - 1 - version, wait_s, rollout.stats))
        return rollout

    def _take_stats(self, staleness: int, wait_s: float, stats: dict[str, float]) -> dict[str, float]:
        """Staleness, waits and occupancy of a take; the fractions are of the seconds since the previous take."""
        now = time.perf_counter()
        interval_s, self._last_take_s = max(now - self._last_take_s, 1e-9), now
        engine_s = stats.get("async/engine_busy_s", 0.0)
        rollout_cfg, group_size = self.cfg.rollout, self.cfg.algorithm.group_size
        return {
            "async/staleness_mean": float(staleness),
            "async/staleness_max": float(staleness),
            "async/rollout_wait_s": wait_s,
            "async/trainer_wait_frac": min(wait_s / interval_s, 1.0),
            "async/engine_busy_frac": min(engine_s / interval_s, 1.0),
            "async/requests_in_flight": float(len(self._versions) * rollout_cfg.num_prompts * group_size),
        }

    def push(
        self,
        step: int,
        sync: FilesWeightSync | CollectiveWeightSync | AdapterWeightSync | FaultTolerance,
        stream: StreamFactory,
        stop: StopRequests | None,
    ) -> dict[str, float]:
        """After ``step``'s update: queue its weights and batch step+1+k; the sync's metrics.

        ``files`` queues the gathered weights; any other ``sync`` drains, then pushes. Nothing when no batch is left for
        these weights (step+1+k > ``trainer.max_steps``).

        Collectives: the weight gather of ``stream`` (exporting ranks); ``collective`` also a MAX of the leaders'
        drain failures and one of the abort flags (world): an abort signal during the drain skips the push, and a
        leader's failure raises RuntimeError on every rank, naming the engine.
        """
        if step + 1 + self.max_staleness > self.cfg.trainer.max_steps:
            return {}
        if isinstance(sync, FilesWeightSync):
            load, metrics = sync.stage(stream)
            if self._worker is not None and self.partial:
                metrics |= self._update_in_flight(step, load)
            elif self._worker is not None:
                self._worker.submit(_Weights(step=step, load=load))
        else:
            metrics = self.drain(stop)
            if any_rank(stop is not None and stop.abort_requested, group=self.exchange.group):
                return metrics
            metrics |= sync.sync(stream)
        self._version = step
        self._submit(step + 1 + self.max_staleness)
        return metrics

    def _update_in_flight(self, step: int, load: Callable[[], dict[str, float]] | None) -> dict[str, float]:
        """Partial rollouts: load the weights after ``step`` into the running engine now (its requests paused).

        A failure is kept and reported at every later take (as a failed queued load is). ``async/pause_s``: the
        seconds the engine's requests stood still (the load included).
        """
        start, loaded = time.perf_counter(), {}
        try:
            self.collector.engine.update_in_flight(step, None if load is None else lambda: loaded.update(load()))
        except BaseException as err:  # every rank learns of it at the next take, naming the engine
            self._failed_load = self._failed_load or (step, err)
        return loaded | {"async/pause_s": time.perf_counter() - start}

    def drain(self, stop: StopRequests | None) -> dict[str, float]:
        """Wait until every queued batch is sampled (a stop signal leaves the wait); ``async/drain_wait_s``."""
        start, error = time.perf_counter(), None
        try:
            for step in sorted(self._batches):
                self._wait(self._batches[step], stop)
        except StepInterrupted:
            pass
        except RuntimeError as err:  # the other ranks wait in the next collective for this leader
            error = err
        if any_rank(error is not None, group=self.exchange.group):
            raise_leader_failures(error, group=self.exchange.group)
        return {"async/drain_wait_s": time.perf_counter() - start}

    def _raise_failed_load(self) -> None:
        if self._failed_load is not None:
            step, err = self._failed_load
            name = getattr(self.collector.engine, "name", "the rollout engine")
            raise RuntimeError(f"{name}: the in-flight load of the weights after step {step} failed ({err})")

    def _wait(self, batch: _Batch, stop: StopRequests | None) -> None:
        """Wait for ``batch`` (``rollout.timeout_s``; ``stop``'s abort signals leave it) and raise its error."""
        timeout_s = self.cfg.rollout.timeout_s
        finished = wait_until(batch.done.wait, timeout_s, stop)
        name = getattr(self.collector.engine, "name", "the rollout engine")
        if not finished:
            raise RuntimeError(
                f"{name}: the async rollout of step {batch.step} did not finish within rollout.timeout_s="
                f"{timeout_s:g} s; stopping the job"
            )
        if batch.error is not None:
            raise RuntimeError(
                f"{name}: the async rollout of step {batch.step} failed ({type(batch.error).__name__}: {batch.error})"
            ) from batch.error

    def close(self) -> None:
        """Stop the worker thread (idempotent)."""
        if self._worker is not None:
            self._worker.close()
            self._worker = None
