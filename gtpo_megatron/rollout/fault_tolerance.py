"""Engines that survive a failure (``rollout.fault_tolerance``): the others finish the step, the failed one returns.

Every rank holds the same view of the engines (alive, restarts spent) and changes it only after a collective, so
the ranks never disagree on who samples what (engines are led by different ranks, ``plan/engines.py``). The rounds,
the restarts, the syncs with a missing engine and when the job stops: docs/training.md, "Engine failures".
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from gtpo_megatron.parallel.collectives import all_reduce_sum
from gtpo_megatron.plan.engines import EnginePlacement, engine_prompt_range
from gtpo_megatron.rollout.engine_guard import CLOSE_TIMEOUT_S, EngineCall, EngineFailure, GuardedEngine
from gtpo_megatron.rollout.exchange import raise_leader_failures

if TYPE_CHECKING:
    import torch.distributed as dist

    from gtpo_megatron.config import RolloutConfig
    from gtpo_megatron.rollout.collector import RolloutCollector
    from gtpo_megatron.rollout.exchange import EngineTally, ScoredGroup

logger = logging.getLogger(__name__)

Rebuild = Callable[[GuardedEngine | None, list[EnginePlacement]], object]
"""``(this rank's member engine or None, the members' placements) -> weight sync`` (``build._collective_sync``)."""


def deal(prompts: Sequence[int], live: Sequence[int]) -> dict[int, list[int]]:
    """``{engine: its prompts}``: ``prompts`` in contiguous balanced blocks over the ``live`` engines, in order."""
    blocks = {}
    for k, engine in enumerate(live):
        block = engine_prompt_range(len(prompts), num_engines=len(live), index=k)
        blocks[engine] = [prompts[i] for i in block]
    return blocks


@dataclass(frozen=True, slots=True)
class Deal:
    """A round's prompts dealt to the engines live at the deal (an async batch's at its queueing).

    ``blocks``: engine -> global prompt indices; ``moved``: how many of the round's prompts belong to engines that
    were down at the deal.
    """

    blocks: dict[int, list[int]]
    moved: int


class FaultTolerance:
    """This rank's part of the protocol of the module docstring.

    Args:
        placements: every engine's placement (the same list on every rank).
        rank: this rank; it leads ``placements[i]`` when ``leader_rank == rank``.
        collector: this rank's collector when it leads an engine, else None (its ``engine`` is swapped on admission).
        rollout: the ``rollout`` section (``max_restarts``, ``num_prompts``, ``health_check_timeout_s``).
        group: the group every rank of the step is in (``StepExchange.group``; None: one process).
        restart: a new guarded engine for this rank's placement (leaders), else None.
        rebuild: the weight sync over a set of members (:data:`Rebuild`); ``weight_sync``: the one of all engines.
    """

    def __init__(
        self,
        *,
        placements: list[EnginePlacement],
        rank: int,
        collector: RolloutCollector | None,
        rollout: RolloutConfig,
        group: dist.ProcessGroup | None,
        restart: Callable[[], GuardedEngine] | None,
        rebuild: Rebuild,
        weight_sync,
    ) -> None:
        self.placements, self.collector, self.rollout, self.group = placements, collector, rollout, group
        self.restart, self.rebuild, self.weight_sync = restart, rebuild, weight_sync
        self.mine = next((p.index for p in placements if p.leader_rank == rank), None)
        self.alive = [True] * len(placements)
        self.restarts = [0] * len(placements)
        self.members: tuple[int, ...] | None = tuple(range(len(placements)))  # the weight group's engines
        self._restarting: tuple[EngineCall, float] | None = None  # the leader's restart and when its engine failed
        self._cause: BaseException | None = None
        self._moved = 0

    @property
    def num_engines(self) -> int:
        """N, the engines of the run (alive or not)."""
        return len(self.placements)

    def live(self) -> list[int]:
        """Indices of the engines that sample (agreed on every rank)."""
        return [e for e in range(self.num_engines) if self.alive[e]]

    # -------------------------------------------------------------------------------------------------- rollout
    def deal_round(self) -> Deal:
        """A round's P prompts dealt to the live engines (agreed on every rank: ``alive`` is)."""
        num_prompts = self.rollout.num_prompts
        down = [e for e in range(self.num_engines) if not self.alive[e]]
        moved = sum(len(engine_prompt_range(num_prompts, num_engines=self.num_engines, index=e)) for e in down)
        return Deal(deal(list(range(num_prompts)), self.live()), moved)

    def sample_round(
        self, sample: Callable[[list[int]], dict[int, ScoredGroup]], tally: EngineTally, dealt: Deal | None = None
    ) -> dict[int, ScoredGroup]:
        """This rank's scored groups of one round, every prompt sampled by a live engine (every rank calls).

        ``sample``: the leader's ``collector.sample_round`` of a list of global indices. Collectives: one SUM of
        ``[N]`` failure flags per pass. Raises RuntimeError on every rank at a limit (module docstring).
        ``dealt``: the round's deal (async: made at the batch's queueing), else one made now; the blocks of engines
        that failed since move to the live ones before the first pass.
        """
        dealt = self.deal_round() if dealt is None else dealt
        gone = sorted(i for e, block in dealt.blocks.items() if not self.alive[e] for i in block)
        pending = {e: list(block) for e, block in dealt.blocks.items() if self.alive[e]}
        for e, block in deal(gone, self.live()).items():
            pending[e] = pending.get(e, []) + block
        self._moved += dealt.moved + len(gone)
        scored = {}
        while True:
            failed = torch.zeros(self.num_engines, dtype=torch.float64)
            mine = pending.get(self.mine, [])
            if mine and not (tally.aborted or tally.failed):
                try:
                    scored.update(sample(mine))
                except EngineFailure as err:
                    failed[self.mine], self._cause = 1.0, err
                    _kill(self.collector.engine)
                except Exception as err:  # a grader's failure: shared at the exchange, which stops the job
                    tally.fail(err)
            lost = [e for e, flag in enumerate(all_reduce_sum(failed, group=self.group).tolist()) if flag > 0]
            if not lost:
                return scored
            orphaned = sorted(i for e in lost for i in pending[e])
            self._lose(lost, f"{len(orphaned)} prompt(s) of this round move to the engines left")
            pending, self._moved = deal(orphaned, self.live()), self._moved + len(orphaned)

    def step_stats(self) -> dict[str, float]:
        """``rollout/engines_alive``, ``rollout/engine_restarts`` (the run's) and this step's ``requests_moved``."""
        moved, self._moved = self._moved, 0
        return {"rollout/engines_alive": float(len(self.live())), "rollout/engine_restarts": float(sum(self.restarts)),
                "rollout/requests_moved": float(moved)}  # fmt: skip

    # ----------------------------------------------------------------------------------------------- weight sync
    def sync(self, stream) -> dict[str, float]:
        """One weight update of the live and restarted engines (every rank); the sync's metrics, ``rollout/recovery_s``.

        Collectives: a SUM of ``[2N]`` ready flags and seconds, the rebuilt group's rendezvous, the sync's, a SUM of
        ``[N + 1]`` failure flags (and ``raise_leader_failures``' when a sync fails with every engine healthy).
        """
        admitted, seconds = self._agree_ready()
        while True:
            members = tuple(e for e in range(self.num_engines) if self.alive[e] or e in admitted)
            failed, error, metrics = torch.zeros(self.num_engines + 1, dtype=torch.float64), None, {}
            try:
                if members != self.members:
                    self.weight_sync = self.rebuild(self._member_engine(members, admitted),
                                                    [self.placements[e] for e in members])  # fmt: skip
                    self.members = members
                metrics = self.weight_sync.sync(stream)
            except Exception as err:  # agreed below: the other ranks may have seen nothing
                failed[-1], error = 1.0, err
                engine = self._member_engine(members, admitted)
                if engine is not None and not self._healthy(engine):
                    failed[self.mine], self._cause = 1.0, err
                    _kill(engine)
            failed = all_reduce_sum(failed, group=self.group).tolist()
            if failed[-1] == 0:
                break
            lost = [e for e in members if failed[e] > 0]
            if not lost:
                raise_leader_failures(error, group=self.group)
            if error is not None:
                logger.warning("the weight sync failed here (%s: %s); engines lost: %s", type(error).__name__,
                               str(error).splitlines()[0], lost)  # fmt: skip
            if admitted.get(self.mine) is not None and self.mine in lost:
                self.collector.engine = admitted[self.mine]  # the restart below kills it
            admitted = {e: g for e, g in admitted.items() if e not in lost}
            self._lose(lost, "the survivors receive the whole update again")
        for e, engine in admitted.items():
            self.alive[e] = True
            if engine is not None:
                self.collector.engine = engine
                logger.warning("%s is back, %.1f s after it failed (restart %d of rollout.max_restarts=%d), with "
                               "the current weights", engine.name, seconds[e], self.restarts[e],
                               self.rollout.max_restarts)  # fmt: skip
        return {**metrics, **({"rollout/recovery_s": max(seconds[e] for e in admitted)} if admitted else {})}

    def _member_engine(self, members: tuple[int, ...], admitted: dict) -> GuardedEngine | None:
        if self.mine not in members:
            return None
        engine = admitted.get(self.mine) or self.collector.engine
        engine.unusable = None  # it receives a whole update before it samples again
        return engine

    def _healthy(self, engine: GuardedEngine) -> bool:
        """Whether ``engine`` stays healthy for ``health_check_timeout_s`` (vLLM reports a dead worker late)."""
        probe = getattr(engine.engine, "check_health", None)
        if probe is None:
            return True
        timeout_s = self.rollout.health_check_timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                EngineCall(probe, "health check").result(timeout_s)
            except Exception:
                return False
            left = deadline - time.monotonic()
            if left <= 0:
                return True
            time.sleep(min(self.rollout.health_check_interval_s, left))

    def _agree_ready(self) -> tuple[dict[int, GuardedEngine | None], list[float]]:
        """The restarted engines every rank admits (this rank's new engine, None elsewhere) and their seconds."""
        flags, n, engine = torch.zeros(2 * self.num_engines, dtype=torch.float64), self.num_engines, None
        if self._restarting is not None and self._restarting[0].finished(0.0):
            (call, lost_at_s), self._restarting = self._restarting, None  # seconds: failure to a started engine
            try:
                engine = call.result(0.0)
                flags[self.mine], flags[n + self.mine] = 1.0, time.monotonic() - lost_at_s
            except Exception as err:
                flags[self.mine], self._cause = 2.0, err
        flags = all_reduce_sum(flags, group=self.group).tolist()
        self._lose([e for e in range(n) if flags[e] == 2.0], "its restart failed")
        admitted = {e: (engine if e == self.mine else None) for e in range(n) if flags[e] == 1.0}
        return admitted, flags[n:]

    # ------------------------------------------------------------------------------------------- losses, restarts
    def _lose(self, lost: list[int], what: str) -> None:
        """Mark ``lost`` failed on every rank; stop the job at a limit, else restart them (their leaders)."""
        if not lost:
            return
        for e in lost:
            self.alive[e] = False
        self.members = None  # the next sync builds the weight group again, without them
        spent = [e for e in lost if self.restarts[e] >= self.rollout.max_restarts]
        names = "; ".join(self.placements[e].describe() for e in spent or lost)
        cause, self._cause = self._cause, None
        if spent or not self.live():
            why = f"{len(spent)} engine(s) failed with rollout.max_restarts={self.rollout.max_restarts} restarts spent"
            if not spent:
                why = f"no engine is left of {self.num_engines}"
            seen = f" ({type(cause).__name__}: {cause})" if cause is not None else ""
            raise RuntimeError(f"{names} failed{seen}; {why}: stopping the job")
        for e in lost:
            self.restarts[e] += 1
        if self.mine in lost:
            logger.warning("%s failed (%s: %s); %s; restart %d of rollout.max_restarts=%d in the background",
                           self.placements[self.mine].describe(), type(cause).__name__, cause, what,
                           self.restarts[self.mine], self.rollout.max_restarts)  # fmt: skip
            self._start_restart()

    def _start_restart(self) -> None:
        old, cores, restart = self.collector.engine, self.collector.cores, self.restart
        old.unusable = old.unusable or "failed: restarting"

        def run() -> GuardedEngine:
            if cores is not None:  # this thread only: the new engine's processes inherit the engine's cores
                os.sched_setaffinity(0, cores)
            _kill(old)
            with contextlib.suppress(Exception):  # its processes are gone already
                old.close()
            return restart()

        self._restarting = (EngineCall(run, "restarting the engine"), time.monotonic())

    def close(self) -> None:
        """Close an engine restarted but not admitted (waits ``CLOSE_TIMEOUT_S`` at most for its start)."""
        if self._restarting is None:
            return
        call, self._restarting = self._restarting[0], None
        if call.finished(CLOSE_TIMEOUT_S):
            with contextlib.suppress(Exception):  # a failed restart has nothing to close
                call.result(0.0).close()


def _kill(engine: GuardedEngine) -> None:
    """Kill a failed engine's processes now, where it can (a stopped one would hold the weight group's sockets)."""
    kill = getattr(engine.engine, "kill", None)
    if kill is not None:
        kill()
