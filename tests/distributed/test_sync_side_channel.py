"""An engine that stops during a real collective weight sync (gloo, ranks and engine workers as threads of this
process): its leader's health check says so on the weight group's side channel, the sender and the other engine
stop waiting on it, the ranks drop it and the survivor receives the whole update again from a rebuilt group.

The weight group's timeout is ``rollout.timeout_s=120`` and every barrier gives up after ``WAIT_S``: the step can
only pass through the side channel, and the errors say so (a timeout reads "Timed out waiting ..."). The time from
the fault to the end of the sync is printed, not asserted.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch

from gtpo_megatron.build_rollout import build_weight_sync
from gtpo_megatron.parallel.collectives import wait_broadcast
from gtpo_megatron.parallel.weight_group import join_weight_group
from gtpo_megatron.plan.engines import EnginePlacement
from gtpo_megatron.rollout import push
from gtpo_megatron.rollout.engine_guard import GuardedEngine, HealthCheck
from gtpo_megatron.rollout.fault_tolerance import FaultTolerance
from gtpo_megatron.rollout.vllm_worker import WeightReloadExtension
from tests.rollout.ft_fakes import WAIT_S, ThreadWorld, ft_config

pytestmark = pytest.mark.distributed

STREAM = [("big.weight", torch.ones(2**22)), ("small.bias", torch.ones(4))]  # 16 MiB: more than a socket buffers


class _Worker(WeightReloadExtension):
    """The real worker extension (join, receive, abandon the old link) with a load that only counts names."""

    rank = 0

    def __init__(self) -> None:
        self.updates, self.errors = [], []

    def reload_weights(self, weights_iterator):
        try:
            self.updates.append([name for name, _ in weights_iterator])
        except RuntimeError as err:
            self.errors.append(str(err))
            raise

    def _gtpo_repack_after_reload(self) -> None:
        pass


class _Engine:
    """A rollout engine around :class:`_Worker`; with ``stopped`` it stops (SIGSTOP) at its first receive: it takes
    no part in the broadcasts and its health check fails, until killed."""

    def __init__(self, stopped: threading.Event | None = None) -> None:
        self.worker, self.stopped, self.killed = _Worker(), stopped, threading.Event()

    def join_weight_group(self, spec: dict, worker_offset: int) -> None:
        self.worker.gtpo_join_weight_group(spec, worker_offset)

    def receive_weights(self):
        if self.stopped is not None:
            self.stopped_at = time.perf_counter()
            self.stopped.set()
            self.killed.wait(WAIT_S)
            raise RuntimeError("killed")
        return [self.worker.gtpo_receive_weights()]

    def check_health(self) -> None:
        if self.stopped is not None and self.stopped.is_set():
            raise RuntimeError("engine process 4242 (VLLM::EngineCore) is stopped")

    def kill(self) -> None:
        self.killed.set()

    def close(self) -> None:
        pass


def _rank(cfg, rank: int, engine: _Engine) -> FaultTolerance:
    placements = [EnginePlacement(index=i, num_engines=2, leader_rank=i, ranks=(i,), devices=()) for i in range(2)]
    health = HealthCheck.from_config(cfg.rollout)
    guard = lambda e: GuardedEngine(e, placement=placements[rank], timeout_s=cfg.rollout.timeout_s, health=health)  # noqa: E731
    groups = SimpleNamespace(rank=rank, world_size=2, in_weight_gather=rank == 0)
    rebuild = lambda engine, members: build_weight_sync(cfg, groups, engine, members, policy=None)  # noqa: E731
    collector = SimpleNamespace(engine=guard(engine), cores=None)
    return FaultTolerance(placements=placements, rank=rank, collector=collector, rollout=cfg.rollout, group=None,
                          restart=lambda: guard(_Engine()), rebuild=rebuild,
                          weight_sync=rebuild(collector.engine, placements))  # fmt: skip


def test_an_engine_stopped_during_a_sync_is_dropped_through_the_side_channel_not_the_timeout(monkeypatch):
    cfg = ft_config(2, "rollout.timeout_s=120", "rollout.weight_sync_bucket_mb=1")
    world = ThreadWorld(2, monkeypatch)
    monkeypatch.setattr(push, "broadcast_object", lambda obj, *, src, group: world.all_gather_object(obj)[src])
    sender_errors, real_send = [], push.send_weights

    def send(*args, **kwargs):
        try:
            return real_send(*args, **kwargs)
        except RuntimeError as err:
            sender_errors.append(str(err))
            raise

    monkeypatch.setattr(push, "send_weights", send)
    stopped, joins = threading.Event(), []
    engines = [_Engine(), _Engine(stopped)]
    joined = lambda spec, **kw: joins.append(spec) or join_weight_group(spec, **kw)  # noqa: E731
    monkeypatch.setattr(push, "join_weight_group", joined)

    def fn(rank):
        ft = _rank(cfg, rank, engines[rank])
        metrics = ft.sync(lambda: iter(STREAM))
        return metrics, ft.live(), time.perf_counter()

    results = world.run(fn)
    assert all(not isinstance(r, BaseException) for r in results), results
    reason = "the weight update was abandoned: engine 1 of 2 (leader rank 1, ranks [1]) failed during the weight update"
    assert sender_errors and sender_errors[0].startswith(reason)  # the side channel's key, not the group's timeout
    survivor = engines[0].worker
    assert survivor.errors and survivor.errors[0].startswith(reason)
    assert survivor.updates == [[name for name, _ in STREAM]]  # the whole update, from the rebuilt group
    assert [spec.world_size for spec in joins] == [3, 2]  # the sender's groups: both engines, then engine 0 alone
    assert [live for _, live, _ in results] == [[0], [0]] and results[0][0]["sync/num_tensors"] == 2
    print(f"[side channel] stopped engine -> sync done after {results[0][2] - engines[1].stopped_at:.2f} s "
          f"(rollout.timeout_s={cfg.rollout.timeout_s:g})")  # fmt: skip


class _RacingWork:
    """A broadcast that completes just after a timed wait expired (``wait(poll)`` raises, ``is_completed`` is True)."""

    def __init__(self, error: Exception | None) -> None:
        self.error, self.waits = error, []

    def wait(self, timeout=None):
        self.waits.append(timeout)
        if timeout is not None:
            raise RuntimeError("Operation timed out!")
        if self.error is not None:
            raise self.error

    def is_completed(self) -> bool:
        return True


@pytest.mark.parametrize("error", [None, RuntimeError("Connection reset by peer")], ids=["completed", "failed"])
def test_a_broadcast_completing_as_its_wait_slice_expires_gives_its_own_result(error):
    store = torch.distributed.HashStore()
    group = SimpleNamespace(
        pg=torch.distributed.ProcessGroupGloo(store, 0, 1, timedelta(seconds=5)), failure=lambda: None
    )
    work = _RacingWork(error)
    if error is None:
        wait_broadcast(work, group=group)  # not the slice's "Operation timed out!"
    else:
        with pytest.raises(RuntimeError, match="Connection reset by peer"):
            wait_broadcast(work, group=group)
    assert work.waits[-1] is None  # waited for its own result
