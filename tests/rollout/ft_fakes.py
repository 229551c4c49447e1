"""Fault-tolerance stand-ins: engines that die, hang or fail a weight sync (and a partial-rollout one), a fake
weight sync, and ``ThreadWorld``, ranks as threads of one process whose SUM all-reduce, MAX of a flag and object
all-gather meet at a barrier (the protocol's own logic is what is tested; tests/distributed/test_fault_tolerance_gloo.py
runs it on gloo)."""

from __future__ import annotations

import threading

import torch

from gtpo_megatron.config import load_config
from gtpo_megatron.data.datasets import load_problems
from gtpo_megatron.data.loader import PromptLoader
from gtpo_megatron.plan.engines import EnginePlacement
from gtpo_megatron.rollout import collector as collector_module
from gtpo_megatron.rollout import exchange as exchange_module
from gtpo_megatron.rollout import fault_tolerance as ft_module
from gtpo_megatron.rollout import pipeline as pipeline_module
from gtpo_megatron.rollout.collector import collect_step
from gtpo_megatron.rollout.engine_guard import GuardedEngine, HealthCheck
from gtpo_megatron.rollout.exchange import StepExchange
from gtpo_megatron.rollout.fault_tolerance import FaultTolerance
from gtpo_megatron.rollout.pipeline import AsyncRollouts
from tests.trainer.fakes import SeededFakeEngine, fake_collector

WAIT_S = 60.0  # every wait in these tests is bounded generously; none is asserted


def ft_config(num_engines: int, *extra: str):
    """A sync run of ``num_engines`` engines with fault tolerance, checks every 0.05 s, 2 prompts per engine."""
    return load_config(None, ["model=builtin:tiny-qwen2", "output_dir=/tmp/unused", "algorithm.group_size=2",
                              f"rollout.num_prompts={2 * num_engines}", "rollout.max_tokens=4",
                              f"rollout.num_engines={num_engines}", "rollout.fault_tolerance=true",
                              "rollout.health_check_interval_s=0.05", "rollout.health_check_timeout_s=0.2",
                              "rollout.health_check_first_wait_s=0", "rollout.timeout_s=30", *extra])  # fmt: skip


class FaultyEngine(SeededFakeEngine):
    """A seeded fake engine that dies (``die``), hangs with its process stopped (``stop``) or hangs silently
    (``hang``: generation and health check block) at its ``at``-th generate call, or (``sync_death``) during its
    ``at``-th weight receive. ``received``: the updates it applied whole; ``version``: the weights it holds (the
    start weights 0; None for a restarted engine until an update reached it); ``served``: ``(step, version)`` of
    each generation."""

    def __init__(self, fault: str | None = None, at: int = 1, version: int | None = 0):
        super().__init__()
        self.fault, self.at = fault, at
        self.dead = self.stopped = False
        self.release = threading.Event()
        self.received = 0
        self.receives = 0
        self.version, self.served = version, []

    def generate(self, prompt_ids, n, sampling, prompt_indices=None):
        if self.fault in ("die", "stop", "hang") and len(self.calls) + 1 >= self.at:
            self.calls.append(([], n, sampling))
            if self.fault == "die":
                self.dead = True
                raise RuntimeError("EngineDeadError: the engine core died")
            self.stopped = self.fault == "stop"
            self.release.wait(WAIT_S)  # left behind (daemon thread)
        self.check_health()
        self.served.append((sampling.seed // 1000, self.version))
        return super().generate(prompt_ids, n, sampling, prompt_indices)

    def check_health(self):
        if self.fault == "hang" and self.release is not None and len(self.calls) >= self.at:
            self.release.wait(WAIT_S)
        if self.dead or self.stopped:
            raise RuntimeError("engine process 4242 (VLLM::EngineCore) is " + ("stopped" if self.stopped else "gone"))

    def receive(self, version: int | None = None):
        self.receives += 1
        if self.fault == "sync_death" and self.receives >= self.at:
            self.dead = True
            raise RuntimeError("Connection closed by peer")
        self.received, self.version = self.received + 1, version

    def kill(self):
        self.dead, self.stopped = True, False
        self.release.set()


class PartialEngine(FaultyEngine):
    """A ``FaultyEngine`` that pauses and resumes (``log``) and records each token's version (the weights it holds).

    ``die`` here dies sampling batch ``at`` once the batches ``after`` are served (the batches generate side by
    side), and stays dead.
    """

    def __init__(self, fault: str | None = None, at: int = 1, version: int | None = 0, after: tuple[int, ...] = (1,)):
        super().__init__(None if fault == "die" else fault, at, version)
        self.dies_at, self.after = (at if fault == "die" else None), set(after)
        self.served_steps = threading.Condition()
        self.log: list[str] = []

    def pause(self):
        self.log.append("pause")

    def resume(self, version):
        self.version = self.version if version is None else version
        self.log.append(f"resume{version}")

    def receive(self, version=None):
        self.log.append("receive")
        super().receive(version)

    def generate(self, prompt_ids, n, sampling, prompt_indices=None):
        step = sampling.seed // 1000
        if self.dies_at is not None and (self.dead or step == self.dies_at):
            with self.served_steps:
                assert self.served_steps.wait_for(lambda: self.after <= {s for s, _ in self.served}, WAIT_S)
            self.calls.append(([], n, sampling))
            self.dead = True
            raise RuntimeError("EngineDeadError: the engine core died")
        groups = super().generate(prompt_ids, n, sampling, prompt_indices)
        for completion in (c for g in groups for c in g.completions):
            completion.token_versions = [self.version] * len(completion.token_ids)
        with self.served_steps:
            self.served_steps.notify_all()
        return groups


class FakeSync:
    """A weight sync of ``members``: this rank's member engine receives (the sender's part is not modelled); the
    stream's ``("version", v)`` item, if any, labels the update."""

    def __init__(self, engine: GuardedEngine | None, members: list[EnginePlacement], log: list):
        self.engine, self.members = engine, [p.index for p in members]
        log.append(tuple(self.members))

    def sync(self, stream):
        version = dict(stream()).get("version")
        if self.engine is not None:
            receive = lambda: self.engine.engine.receive(version)  # noqa: E731
            self.engine.wait(ft_module.EngineCall(receive, "weight update (collective)"))
        return {"sync/num_tensors": 1.0}


class ThreadWorld:
    """``size`` ranks as threads: :meth:`run` calls ``fn(rank)`` in each and returns results or exceptions."""

    def __init__(self, size: int, monkeypatch):
        self.size, self.barrier, self.slots = size, threading.Barrier(size), [None] * size
        self.local = threading.local()
        for module in (ft_module, collector_module):
            monkeypatch.setattr(module, "all_reduce_sum", self.all_reduce_sum)
        monkeypatch.setattr(exchange_module, "all_gather_object", self.all_gather_object)
        monkeypatch.setattr(pipeline_module, "any_rank", self.any_rank)

    def _gather(self, value):
        self.slots[self.local.rank] = value
        self.barrier.wait(WAIT_S)
        values = list(self.slots)
        self.barrier.wait(WAIT_S)
        return values

    def all_reduce_sum(self, tensor, *, group=None):
        return torch.stack(self._gather(tensor.clone())).sum(dim=0)

    def all_gather_object(self, obj, *, group=None):
        return self._gather(obj)

    def any_rank(self, flag, *, group=None):
        return any(self._gather(bool(flag)))

    def run(self, fn) -> list:
        results = [None] * self.size

        def entry(rank):
            self.local.rank = rank
            try:
                results[rank] = fn(rank)
            except BaseException as err:  # the others leave at a barrier's time limit, if ever they wait
                results[rank] = err

        threads = [threading.Thread(target=entry, args=(r,), daemon=True) for r in range(self.size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(WAIT_S)
        return results


class Rank:
    """One rank leading engine ``rank`` (a fresh engine of its class on each restart); ``group``: the ranks' group."""

    def __init__(self, cfg, rank: int, engine: FaultyEngine, sync_log: list, group=None):
        self.cfg, self.rank = cfg, rank
        n = cfg.rollout.num_engines
        self.placements = [EnginePlacement(index=i, num_engines=n, leader_rank=i, ranks=(i,), devices=())
                           for i in range(n)]  # fmt: skip
        self.exchange = StepExchange.from_config(cfg, num_engines=n, group=group)
        self.collector = fake_collector(cfg, self.guard(engine), exchange=self.exchange, engine_index=rank)
        self.loader = PromptLoader(load_problems("synthetic", limit=40), batch_size=cfg.rollout.num_prompts, seed=0)
        self.restarted: list[FaultyEngine] = []
        rebuild = lambda engine, members: FakeSync(engine, members, sync_log)  # noqa: E731
        self.ft = FaultTolerance(placements=self.placements, rank=rank, collector=self.collector, rollout=cfg.rollout,
                                 group=group, restart=self.restart, rebuild=rebuild,
                                 weight_sync=FakeSync(self.collector.engine, self.placements, []))  # fmt: skip

    def guard(self, engine) -> GuardedEngine:
        health = HealthCheck.from_config(self.cfg.rollout)
        return GuardedEngine(engine, placement=self.placements[self.rank], timeout_s=self.cfg.rollout.timeout_s,
                             health=health)  # fmt: skip

    def restart(self) -> GuardedEngine:
        self.restarted.append(type(self.collector.engine.engine)(version=None))
        return self.guard(self.restarted[-1])

    def step(self, step: int):
        return collect_step(self.collector, self.loader, step, self.exchange, recovery=self.ft)

    def run_async(self) -> list[tuple]:
        """The trainer's async loop (``rollout.mode: async``): ``(rollout, push metrics)`` of every step; before a
        push that syncs, the queued batches are settled (not with partial rollouts: they load in flight) and a
        restart awaited (so it rejoins at that sync)."""
        k, steps, out = self.cfg.rollout.max_staleness, self.cfg.trainer.max_steps, []
        rollouts = AsyncRollouts(self.cfg, collector=self.collector, loader=self.loader, exchange=self.exchange,
                                 recovery=self.ft)  # fmt: skip
        try:
            rollouts.start(0)
            for step in range(1, steps + 1):
                rollout = rollouts.take(step, None)
                if step + 1 + k <= steps:
                    if not self.cfg.rollout.partial_rollouts:
                        rollouts.drain(None)
                    if self.ft._restarting is not None:
                        assert self.ft._restarting[0].finished(WAIT_S)
                out.append((rollout, rollouts.push(step, self.ft, lambda s=step: iter([("version", s)]), None)))
        finally:
            rollouts.close()
        return out
