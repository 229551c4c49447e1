"""An engine leader's background worker for async rollouts: its queue of batches and weight loads, run in order.

``rollout/pipeline.py`` owns the schedule; an urgent item (``rollout/async_recovery.py``) runs next.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gtpo_megatron.rollout.busy_clock import BusyClock
from gtpo_megatron.rollout.exchange import EngineTally

if TYPE_CHECKING:
    from collections.abc import Callable

    from gtpo_megatron.data.types import Problem
    from gtpo_megatron.rollout.collector import RolloutCollector
    from gtpo_megatron.rollout.exchange import ScoredGroup

_URGENT, _QUEUED = 0, 1


@dataclass
class Batch:
    """One step's batch on an engine leader: its prompts, and what the worker made of them.

    ``share``: the global indices fault tolerance dealt it (None: its own); ``cancelled``: another engine samples it.
    """

    step: int
    problems: list[Problem]
    share: list[int] | None = None
    done: threading.Event = field(default_factory=threading.Event)
    scored: dict[int, ScoredGroup] = field(default_factory=dict)
    tally: EngineTally = field(default_factory=EngineTally)
    error: BaseException | None = None
    cancelled: bool = False


@dataclass(frozen=True)
class Weights:
    """The weights after ``step``, queued between two batches: ``load`` puts them into the engine."""

    step: int
    load: Callable[[], object]


class Worker:
    """A daemon thread that runs a leader's queue of batches and weight loads in order (on the collector's cores).

    ``streaming`` (partial rollouts): each batch sampled in a thread of its own as soon as it is queued.
    """

    def __init__(self, collector: RolloutCollector, *, streaming: bool = False) -> None:
        self._streaming, self.clock = streaming, BusyClock()
        self._order = itertools.count()  # FIFO within a priority (submitted from the main thread only)
        self._queue: queue.PriorityQueue[tuple[int, int, Batch | Weights | None]] = queue.PriorityQueue()
        self._thread = threading.Thread(target=self._run, args=(collector,), name="gtpo-async-rollout", daemon=True)
        self._thread.start()

    def submit(self, item: Batch | Weights, *, urgent: bool = False) -> None:
        """Queue ``item``; ``urgent``: before every queued item (after the one in progress)."""
        self._queue.put((_URGENT if urgent else _QUEUED, next(self._order), item))

    def close(self) -> None:
        """Stop after the queued items (the engine's close ends a hung one)."""
        self._queue.put((_QUEUED, next(self._order), None))

    def _run(self, collector: RolloutCollector) -> None:
        if collector.cores is not None:  # this thread only: the training rank keeps its cores
            os.sched_setaffinity(0, collector.cores)
        failed_load: tuple[int, BaseException] | None = None  # every later batch fails: its weights are wrong
        while (item := self._queue.get()[2]) is not None:
            if isinstance(item, Weights):
                try:
                    item.load()
                except BaseException as err:  # reported with the next batch, at its take
                    failed_load = failed_load or (item.step, err)
                continue
            if self._streaming:
                threading.Thread(target=sample_batch, args=(collector, item, None, self.clock),
                                 name=f"gtpo-batch-{item.step}", daemon=True).start()  # fmt: skip
            else:
                sample_batch(collector, item, failed_load, self.clock)


def sample_batch(
    collector: RolloutCollector, batch: Batch, failed_load: tuple[int, BaseException] | None, clock: BusyClock
) -> None:
    """Sample and score ``batch`` with ``clock`` running; refused after a failed queued load (errors kept for take)."""
    if batch.cancelled:
        batch.done.set()
        return
    clock.enter()
    try:
        if failed_load is not None:
            step, err = failed_load
            raise RuntimeError(f"loading the weights after step {step} failed ({type(err).__name__}: {err})")
        batch.scored = collector.sample_round(batch.step, 0, batch.problems, batch.tally, batch.share)
    except BaseException as err:  # handed to the main thread at take or drain
        batch.error = err
    finally:
        clock.leave()
        batch.done.set()
