"""Fault tolerance in async mode: every queued batch settled by ``FaultTolerance``'s rounds before weights move.

Dealt at queueing (``FaultTolerance.deal_round``), settled at the take or the drain before a sync, whichever comes
first (``sample_round``; moved prompts run as urgent items on the survivors' workers): docs/training.md, "Engine
failures".
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gtpo_megatron.preemption import StepInterrupted, wait_until
from gtpo_megatron.rollout.async_worker import Batch
from gtpo_megatron.rollout.engine_guard import EngineFailure
from gtpo_megatron.rollout.exchange import EngineTally

if TYPE_CHECKING:
    from gtpo_megatron.preemption import StopRequests
    from gtpo_megatron.rollout.async_worker import Worker
    from gtpo_megatron.rollout.exchange import ScoredGroup
    from gtpo_megatron.rollout.fault_tolerance import Deal, FaultTolerance


@dataclass(frozen=True)
class Settled:
    """A batch's rollout on this rank once every prompt was sampled by a live engine, and its recovery metrics."""

    scored: dict[int, ScoredGroup]
    tally: EngineTally
    stats: dict[str, float]


class AsyncRecovery:
    """This rank's part: ``recovery`` (its ``FaultTolerance``) and, on an engine leader, the pipeline's ``worker``.

    ``timeout_s``: ``rollout.timeout_s``; a leader waits twice that for a batch (the item in progress runs first).
    """

    def __init__(self, recovery: FaultTolerance, *, worker: Worker | None, timeout_s: float) -> None:
        self.recovery, self.worker, self.timeout_s = recovery, worker, timeout_s

    def deal(self) -> Deal:
        """A new batch's prompts dealt to the live engines (every rank, at its queueing)."""
        return self.recovery.deal_round()

    def settle(self, batch: Batch | None, dealt: Deal, stop: StopRequests | None) -> Settled:
        """The batch's rollout, every prompt of ``dealt`` sampled by a live engine (every rank, steps in order).

        ``batch``: this leader's, else None. A stop signal during a wait marks the tally aborted. Collectives:
        ``FaultTolerance.sample_round``'s; raises its RuntimeError on every rank at a limit.
        """
        tally = EngineTally() if batch is None else batch.tally
        scored = self.recovery.sample_round(functools.partial(self._sample, batch, stop), tally, dealt)
        return Settled(scored, tally, self.recovery.step_stats())

    @property
    def mine(self) -> int | None:
        """The index of the engine this rank leads, else None."""
        return self.recovery.mine

    @property
    def engine_lost(self) -> bool:
        """Whether this rank leads an engine that is down (the survivors sample its queued batches)."""
        mine = self.recovery.mine
        return mine is not None and not self.recovery.alive[mine]

    def _sample(self, batch: Batch, stop: StopRequests | None, mine: list[int]) -> dict[int, ScoredGroup]:
        """A pass's ``sample``: the worker's groups of ``mine``, the others (moved here) sampled now before its queue.

        A batch cancelled since its queueing (this leader's engine was lost, then restarted and admitted: partial
        rollouts settle without a drain) counts as unsampled: what the lost engine made of it, and its counts, are
        dropped, not waited for.
        Raises the batch's error: ``EngineFailure`` (the engine failed: ``sample_round`` moves the whole block) or
        a grader's (the job stops at the exchange).
        """
        try:
            if batch.cancelled:
                batch.tally.drop_sampled()
            else:
                self._wait(batch, stop)
            scored = {} if batch.cancelled else {i: batch.scored[i] for i in mine if i in batch.scored}
            moved = [i for i in mine if i not in scored]
            if moved:
                extra = Batch(step=batch.step, problems=batch.problems, share=moved, tally=batch.tally)
                self.worker.submit(extra, urgent=True)
                self._wait(extra, stop)
                scored.update(extra.scored)
            return scored
        except StepInterrupted:  # left on a stop signal: the step aborts at the exchange
            batch.tally.aborted = 1.0
            return {}

    def _wait(self, batch: Batch, stop: StopRequests | None) -> None:
        timeout_s = 2 * self.timeout_s
        if not wait_until(batch.done.wait, timeout_s, stop):
            name = getattr(self.recovery.collector.engine, "name", "the rollout engine")
            raise EngineFailure(f"{name}: the async rollout of step {batch.step} did not finish within "
                                f"{timeout_s:g} s (2 x rollout.timeout_s)")  # fmt: skip
        if batch.error is not None:
            raise batch.error
