"""Asynchronous rollouts (``rollout.mode: async``): the engines sample the next steps' batches while the policy trains.

With k = ``rollout.max_staleness`` and s steps completed at the start, every rank follows one schedule, and each
engine leader's worker thread runs its queue strictly in order:

    start     queue batches s+1 .. s+1+k                   (the engines hold the weights after step s)
    step t    take(t) -> train -> queue the weights after step t, then batch t+1+k   (while t+1+k <= max_steps)

What the schedule gives (each batch's weights, the time, the drain, checkpoints, partial rollouts): docs/training.md,
"Asynchronous rollouts"; with ``rollout.fault_tolerance`` each batch is settled by ``rollout/async_recovery.py``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from gtpo_megatron.parallel.collectives import any_rank
from gtpo_megatron.preemption import StepInterrupted, wait_until
from gtpo_megatron.rollout.async_recovery import AsyncRecovery
from gtpo_megatron.rollout.async_worker import Batch, Weights, Worker
from gtpo_megatron.rollout.collector import StepRollout, share_step
from gtpo_megatron.rollout.engine_guard import load_in_flight, resume_quietly
from gtpo_megatron.rollout.exchange import EngineTally, raise_leader_failures
from gtpo_megatron.rollout.push import FilesWeightSync

if TYPE_CHECKING:
    from gtpo_megatron.config import GTPOConfig
    from gtpo_megatron.data.loader import PromptLoader
    from gtpo_megatron.preemption import StopRequests
    from gtpo_megatron.rollout.adapter_sync import AdapterWeightSync
    from gtpo_megatron.rollout.async_recovery import Settled
    from gtpo_megatron.rollout.collector import RolloutCollector
    from gtpo_megatron.rollout.exchange import StepExchange
    from gtpo_megatron.rollout.fault_tolerance import FaultTolerance
    from gtpo_megatron.rollout.push import CollectiveWeightSync, StreamFactory


class AsyncRollouts:
    """The schedule of the module docstring on one rank; ``collector`` is this rank's when it leads an engine.

    Args:
        cfg: the run config (``rollout.max_staleness``, ``rollout.timeout_s``, ``trainer.max_steps``).
        collector: this rank's engine leader's collector, else None.
        loader: the trainer's prompt loader (advanced at take, so checkpoints hold the trained position).
        exchange: the step exchange every batch crosses at take (``collector.share_step``).
        recovery: ``rollout.fault_tolerance``'s (``rollout/async_recovery.py``: batches dealt to the live engines,
            settled at take or at the drain), else None.
    """

    def __init__(
        self,
        cfg: GTPOConfig,
        *,
        collector: RolloutCollector | None,
        loader: PromptLoader,
        exchange: StepExchange,
        recovery: FaultTolerance | None = None,
    ) -> None:
        self.cfg, self.collector, self.loader, self.exchange = cfg, collector, loader, exchange
        self.max_staleness = cfg.rollout.max_staleness
        self._versions: dict[int, int] = {}  # queued, not yet taken: step -> the weights' completed steps
        self._batches: dict[int, Batch] = {}  # the leader's batches of those steps
        self._ahead: PromptLoader | None = None
        self._version = 0
        self._last_take_s = 0.0
        self.partial = cfg.rollout.partial_rollouts  # weights load into the running engines (_push_in_flight)
        self._worker = Worker(collector, streaming=self.partial) if collector is not None else None
        self._failed_load: tuple[int, BaseException] | None = None
        self._recovery = None  # with fault tolerance: every rank's deals and settled batches of the queued steps
        if recovery is not None:
            self._recovery = AsyncRecovery(recovery, worker=self._worker, timeout_s=cfg.rollout.timeout_s)
            self._deals, self._settled = {}, {}

    @property
    def in_flight(self) -> list[int]:
        """Steps whose batches are queued and not trained yet (a resumed run samples them again)."""
        return sorted(self._versions)

    def start(self, completed_steps: int) -> None:
        """Queue the first k+1 batches after ``completed_steps`` (the engines must hold that step's weights)."""
        self._version = completed_steps
        if self._worker is not None and self.partial:  # the engine's tokens carry the start weights' version
            resume_quietly(self.collector.engine, completed_steps)  # failed: its first batch fails, naming it
        self._ahead = self.loader.fork()
        self._last_take_s = time.perf_counter()
        for step in range(completed_steps + 1, completed_steps + 2 + self.max_staleness):
            self._submit(step)

    def _submit(self, step: int) -> None:
        if step > self.cfg.trainer.max_steps:
            return
        problems = self._ahead.next_batch()
        self._versions[step] = self._version
        share = None
        if self._recovery is not None:
            self._deals[step] = dealt = self._recovery.deal()
            share = dealt.blocks.get(self._recovery.mine, [])
        if self._worker is not None:
            self._batches[step] = batch = Batch(step=step, problems=problems, share=share)
            self._worker.submit(batch)

    def take(self, step: int, stop: StopRequests | None) -> StepRollout | None:
        """Step ``step``'s rollout on every rank (None on every rank after a SIGTERM during the wait).

        Adds the ``async/*`` metrics of docs/metrics.md to its stats. Collectives: ``share_step``'s (world); with
        fault tolerance, the batch's settle first unless the drain settled it (``AsyncRecovery.settle``).

        Raises:
            RuntimeError: on every rank, naming the engine, when it or the graders failed on this batch (or on a
                queued weight load before it) or it took over ``rollout.timeout_s``.
        """
        problems = self.loader.next_batch()
        version = self._versions.pop(step)
        tally, scored, start, settled = EngineTally(), {}, time.perf_counter(), None
        if self._worker is not None and self._batches[step].problems != problems:  # the look-ahead drew others
            raise RuntimeError(f"async rollouts: step {step}'s batch holds other prompts than the loader's")
        if self._recovery is not None:
            settled = self._settled.pop(step, None) or self._settle(step, stop)
            scored, tally = settled.scored, settled.tally
            self._batches.pop(step, None)
            self._deals.pop(step)
        elif self._worker is not None:
            batch = self._batches.pop(step)
            try:
                self._raise_failed_load()
                self._wait(batch, stop)
                scored, tally = batch.scored, batch.tally
            except StepInterrupted:
                tally.aborted = 1.0
            except RuntimeError as err:  # shared at the exchange: the other ranks wait there for this batch
                tally.fail(err)
        if self._worker is not None:
            tally.busy_s = self._worker.clock.read()
        wait_s = time.perf_counter() - start
        engine_index = None if self.collector is None else self.collector.engine_index
        rollout = share_step([scored], [], tally, self.exchange, engine_index=engine_index)
        if rollout is not None:
            rollout.stats.update(self._take_stats(step - 1 - version, wait_s, rollout.stats))
            rollout.stats.update(settled.stats if settled is not None else {})  # fault tolerance's rollout/*
        return rollout

    def _settle(self, step: int, stop: StopRequests | None) -> Settled:
        """Settle step ``step``'s batch (every rank); a leader whose engine is lost drops its queued batches."""
        settled = self._recovery.settle(self._batches.get(step), self._deals[step], stop)
        if self._recovery.engine_lost:
            for batch in self._batches.values():
                batch.cancelled = True
        return settled

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

        ``files`` queues the gathered weights; any other ``sync`` drains, then pushes. With partial rollouts nothing
        drains: every path loads into the paused engines (:meth:`_push_in_flight`). Nothing when no batch is left for
        these weights (step+1+k > ``trainer.max_steps``).

        Collectives: the weight gather of ``stream`` (exporting ranks), ``sync``'s; ``collective`` without partial
        rollouts also a MAX of the leaders' drain failures and one of the abort flags (world): an abort signal
        during the drain skips the push, and a leader's failure raises RuntimeError on every rank, naming the engine.
        """
        if step + 1 + self.max_staleness > self.cfg.trainer.max_steps:
            return {}
        if self.partial:
            metrics = self._push_in_flight(step, sync, stream)
        elif isinstance(sync, FilesWeightSync):
            load, metrics = sync.stage(stream)
            if self._worker is not None:
                self._worker.submit(Weights(step=step, load=load))
        else:
            metrics = self.drain(stop)
            if any_rank(stop is not None and stop.abort_requested, group=self.exchange.group):
                return metrics
            metrics |= sync.sync(stream)
        self._version = step
        self._submit(step + 1 + self.max_staleness)
        return metrics

    def _push_in_flight(
        self,
        step: int,
        sync: FilesWeightSync | CollectiveWeightSync | AdapterWeightSync | FaultTolerance,
        stream: StreamFactory,
    ) -> dict[str, float]:
        """Partial rollouts: the weights after ``step`` load into the running engines (:func:`load_in_flight`).

        ``files`` gathers first and loads into rank 0's engine; another path's whole ``sync.sync`` runs on every
        rank, each leader's engine paused around it. A failed ``files`` load is kept and reported at every later take
        (as a failed queued load is); a failed sync raises as it does between batches. An engine that fault
        tolerance admitted during the sync is labelled too. ``async/pause_s``: this leader's engine's still seconds.
        """
        files = isinstance(sync, FilesWeightSync)
        load, metrics = sync.stage(stream) if files else ((lambda: sync.sync(stream)), {})
        before = None if self._worker is None else self.collector.engine
        start = time.perf_counter()
        try:
            metrics |= load_in_flight(before, step, load)
        except BaseException as err:
            if not files:
                raise
            self._failed_load = self._failed_load or (step, err)  # every rank learns of it at the next take
        admitted = None if self._worker is None else self.collector.engine
        if admitted is not before and admitted.unusable is None:  # it received these weights whole
            resume_quietly(admitted, step)
        return metrics if before is None else metrics | {"async/pause_s": time.perf_counter() - start}

    def drain(self, stop: StopRequests | None) -> dict[str, float]:
        """Wait until every queued batch is sampled (a stop signal leaves the wait); ``async/drain_wait_s``."""
        start, error = time.perf_counter(), None
        if self._recovery is not None:  # every rank settles the queued batches: a failed engine's move now
            for step in sorted(set(self._versions) - set(self._settled)):
                settled = self._settle(step, stop)
                if not settled.tally.aborted:  # (an abort signal skips the push and the run stops)
                    self._settled[step] = settled
            return {"async/drain_wait_s": time.perf_counter() - start}
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

    def _wait(self, batch: Batch, stop: StopRequests | None) -> None:
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
