"""Asynchronous rollouts (``rollout.mode: async``): the engines sample the next steps' batches while the policy trains.

With k = ``rollout.max_staleness`` and s steps completed at the start, every rank follows one schedule:

    start     submit batches s+1 .. s+1+k                  (the engines hold the weights after step s)
    step t    take(t) -> train -> drain -> push the weights after step t, submit batch t+1+k (while t+1+k <= max)

so batch j is sampled with the weights after step v_j = max(s, j-1-k) and trains the policy after step j-1: its
staleness (j-1) - v_j is k from step s+k+1 on (k = 1: 0 at the first step, then 1). The schedule decides every
batch's weights, never the timing. Weights reach the engines between their batches: the drain waits until every
submitted batch is sampled, so no generation runs during a push. Prompts are drawn in the main thread, at
submission, from a loader fork that runs ahead; the trainer's loader draws the same batch at take, so a checkpoint
holds the last trained step and the batches in flight (:attr:`AsyncRollouts.in_flight`), sampled again on resume.
A leader's worker thread samples and scores; at take every rank shares the batch (``collector.share_step``). A wait
is bounded by ``rollout.timeout_s`` per batch; a stop signal aborts the step at take and skips only the push after
the drain; a leader's failure reaches every rank at the next collective, naming the engine.
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
from gtpo_megatron.rollout.collector import StepRollout, share_step
from gtpo_megatron.rollout.exchange import EngineTally, raise_leader_failures

if TYPE_CHECKING:
    from collections.abc import Callable

    from gtpo_megatron.config import GTPOConfig
    from gtpo_megatron.data.loader import PromptLoader
    from gtpo_megatron.data.types import Problem
    from gtpo_megatron.preemption import StopRequests
    from gtpo_megatron.rollout.collector import RolloutCollector
    from gtpo_megatron.rollout.exchange import ScoredGroup, StepExchange


@dataclass
class _Batch:
    """One step's batch on an engine leader: its prompts, and what the worker made of them."""

    step: int
    problems: list[Problem]
    done: threading.Event = field(default_factory=threading.Event)
    scored: dict[int, ScoredGroup] = field(default_factory=dict)
    tally: EngineTally = field(default_factory=EngineTally)
    error: BaseException | None = None
    finished_at_s: float = 0.0


class _Worker:
    """A daemon thread that samples and scores the submitted batches in order on a leader's collector (on its cores)."""

    def __init__(self, collector: RolloutCollector) -> None:
        self._queue: queue.Queue[_Batch | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, args=(collector,), name="gtpo-async-rollout", daemon=True)
        self._thread.start()

    def submit(self, batch: _Batch) -> None:
        self._queue.put(batch)

    def close(self) -> None:
        """Stop after the batch in progress (the engine's close ends a hung one)."""
        self._queue.put(None)

    def _run(self, collector: RolloutCollector) -> None:
        if collector.cores is not None:  # this thread only: the training rank keeps its cores
            os.sched_setaffinity(0, collector.cores)
        while (batch := self._queue.get()) is not None:
            try:
                batch.scored = collector.sample_round(batch.step, 0, batch.problems, batch.tally)
            except BaseException as err:  # handed to the main thread at take or drain
                batch.error = err
            finally:
                batch.finished_at_s = time.perf_counter()
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
        self._versions: dict[int, int] = {}  # submitted, not yet taken: step -> the weights' completed steps
        self._batches: dict[int, _Batch] = {}  # the leader's batches of those steps
        self._ahead: PromptLoader | None = None
        self._version = 0
        self._take_wait_s = 0.0
        self._worker = _Worker(collector) if collector is not None else None

    @property
    def in_flight(self) -> list[int]:
        """Steps whose batches are submitted and not trained yet (a resumed run samples them again)."""
        return sorted(self._versions)

    def start(self, completed_steps: int) -> None:
        """Submit the first k+1 batches after ``completed_steps`` (the engines must hold that step's weights)."""
        self._version = completed_steps
        self._ahead = self.loader.fork()
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

        Adds ``async/staleness_mean`` and ``_max`` to its stats. Collectives: ``share_step``'s (world).

        Raises:
            RuntimeError: on every rank, naming the engine, when it or the graders failed on this batch or it took
                over ``rollout.timeout_s``.
        """
        problems = self.loader.next_batch()
        version = self._versions.pop(step)
        tally, scored, start = EngineTally(), {}, time.perf_counter()
        if self._worker is not None:
            batch = self._batches.pop(step)
            if batch.problems != problems:  # the look-ahead and the trainer's loader drew different prompts
                raise RuntimeError(f"async rollouts: step {step}'s batch holds other prompts than the loader's")
            try:
                self._wait(batch, stop)
                scored, tally = batch.scored, batch.tally
            except StepInterrupted:
                tally.aborted = 1.0
            except RuntimeError as err:  # shared at the exchange: the other ranks wait there for this batch
                tally.fail(err)
        self._take_wait_s = time.perf_counter() - start
        engine_index = None if self.collector is None else self.collector.engine_index
        rollout = share_step([scored], [], tally, self.exchange, engine_index=engine_index)
        if rollout is not None:
            staleness = float(step - 1 - version)
            rollout.stats.update({"async/staleness_mean": staleness, "async/staleness_max": staleness})
        return rollout

    def drain(self, stop: StopRequests | None) -> dict[str, float]:
        """Wait until every submitted batch is sampled (a stop signal leaves the wait); ``async/rollout_wait_s``.

        Only leaders wait; the caller agrees on a stop before :meth:`push`. Collectives: a MAX of the leaders'
        failures (world), then ``raise_leader_failures``', which raises RuntimeError on every rank as :meth:`take`.
        """
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
        return {"async/rollout_wait_s": self._take_wait_s + time.perf_counter() - start}

    def push(self, step: int, push: Callable[[], dict[str, float]]) -> dict[str, float]:
        """After :meth:`drain`: ``push`` the weights after ``step`` and submit batch step+1+k; ``push``'s metrics.

        ``async/weight_wait_s``: the engines' idle time from their last batch to the next one (after this push); no
        push and 0 when no batch is left to sample with these weights (step + 1 + k > ``trainer.max_steps``).
        """
        if step + 1 + self.max_staleness > self.cfg.trainer.max_steps:
            return {"async/weight_wait_s": 0.0}
        finished_s = [b.finished_at_s for b in self._batches.values()]
        metrics = push()
        self._version = step
        self._submit(step + 1 + self.max_staleness)
        idle_s = time.perf_counter() - max(finished_s) if finished_s else 0.0
        return {**metrics, "async/weight_wait_s": idle_s}

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
