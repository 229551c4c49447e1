"""The collective weight path over a real gloo weight group: the bucket protocol, the sync roles, timeouts.

Members are threads of this process (gloo process groups built directly from a store, ``parallel/weight_group.py``,
need no default group and no spawn), so these tests take well under a second each; the real engines' side is in
``tests/integration/test_collective_sync.py``.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from gtpo_megatron.parallel.weight_group import (
    WeightGroupSpec,
    join_as_worker,
    join_weight_group,
    open_weight_store,
)
from gtpo_megatron.plan.engines import EnginePlacement
from gtpo_megatron.rollout.engine_guard import GuardedEngine
from gtpo_megatron.rollout.push import CollectiveWeightSync, connect_weight_group
from gtpo_megatron.rollout.weight_wire import WireStats, receive_weights, send_weights

pytestmark = pytest.mark.distributed


def _groups(world_size: int, timeout_s: float = 10.0):
    """``world_size`` joined members (rank 0 first), each joined from its own thread."""
    store = open_weight_store("127.0.0.1", world_size=world_size, timeout_s=timeout_s)
    spec = WeightGroupSpec(host="127.0.0.1", port=store.port, world_size=world_size, backend="gloo",
                           timeout_s=timeout_s)  # fmt: skip
    with ThreadPoolExecutor(world_size) as pool:
        futures = [pool.submit(join_weight_group, spec, rank=r, store=store if r == 0 else None)
                   for r in range(world_size)]  # fmt: skip
        return [f.result() for f in futures]


def _stream():
    gen = torch.Generator().manual_seed(0)
    shapes = {"a.weight": (3, 5), "b.bias": (7,), "c.weight": (40, 10), "d.weight": (2, 2), "e.norm": (1,)}
    return [(name, torch.randn(shape, generator=gen)) for name, shape in shapes.items()]


def _collect(group, stats):
    return [(name, tensor.clone()) for name, tensor in receive_weights(group, stats)]


def test_buckets_reach_every_worker_cast_to_the_engine_dtype():
    sender, *workers = _groups(3)
    stream = _stream()
    with ThreadPoolExecutor(2) as pool:
        stats = [WireStats(), WireStats()]
        received = [pool.submit(_collect, group, s) for group, s in zip(workers, stats)]
        # a 128-byte budget = two 64-byte buckets in flight; bfloat16 (2 bytes a value):
        # [a (30 B), b (14 B)] | c (800 B) alone | [d (8 B), e (2 B)]
        sent = send_weights(iter(stream), group=sender, bucket_bytes=128, dtype=torch.bfloat16)
        got = [f.result() for f in received]
    assert (sent.num_tensors, sent.num_bytes) == (5, 2 * (15 + 7 + 400 + 4 + 1))
    assert (sent.num_buckets, sent.max_bucket_bytes) == (3, 800)
    for worker, s in zip(got, stats):
        assert [name for name, _ in worker] == [name for name, _ in stream]
        for (_, tensor), (_, original) in zip(worker, stream):
            assert tensor.dtype == torch.bfloat16 and tensor.shape == original.shape
            assert torch.equal(tensor, original.to(torch.bfloat16))
        assert (s.num_tensors, s.num_bytes, s.num_buckets) == (sent.num_tensors, sent.num_bytes, sent.num_buckets)


def test_bucket_boundaries_follow_the_byte_budget():
    sender, worker = _groups(2)
    sizes = [(f"t{i}", torch.ones(n)) for i, n in enumerate([10, 10, 10, 30, 5])]  # fp32: 40, 40, 40, 120, 20 bytes
    with ThreadPoolExecutor(1) as pool:
        stats = WireStats()
        received = pool.submit(_collect, worker, stats)
        sent = send_weights(iter(sizes), group=sender, bucket_bytes=200, dtype=torch.float32)
        assert [name for name, _ in received.result()] == ["t0", "t1", "t2", "t3", "t4"]
    # buckets of 200 / 2 = 100 bytes: [t0, t1] = 80 | t2 = 40 (t3 would pass 100) | t3 = 120 alone | t4 = 20
    assert (sent.num_buckets, sent.max_bucket_bytes, stats.num_buckets) == (4, 120, 4)


def test_a_failed_stream_aborts_the_workers_at_once():
    """The sender's stream raises after one bucket: the workers are told to abort and raise without waiting for
    the group's timeout (60 s here)."""
    sender, worker = _groups(2, timeout_s=60.0)

    def broken():
        yield "a", torch.ones(4)
        raise RuntimeError("trainer failed while gathering")

    with ThreadPoolExecutor(1) as pool:
        received = pool.submit(_collect, worker, None)
        start = time.perf_counter()
        with pytest.raises(RuntimeError, match="trainer failed while gathering"):
            send_weights(broken(), group=sender, bucket_bytes=8, dtype=torch.float32)
        with pytest.raises(RuntimeError, match="the sender aborted the weight update half-way"):
            received.result()
        assert time.perf_counter() - start < 5


def test_a_silent_sender_fails_the_workers_within_the_timeout():
    """A sender that stops sending (a hung gather) fails the waiting worker after ``timeout_s``, not never."""
    sender, worker = _groups(2, timeout_s=1.0)
    with ThreadPoolExecutor(1) as pool:
        received = pool.submit(_collect, worker, None)
        start = time.perf_counter()
        with pytest.raises(RuntimeError):
            received.result()
        assert 0.9 < time.perf_counter() - start < 5
    del sender


def test_a_member_that_never_joins_fails_the_rendezvous():
    store = open_weight_store("127.0.0.1", world_size=2, timeout_s=1.0)
    spec = WeightGroupSpec(host="127.0.0.1", port=store.port, world_size=2, backend="gloo", timeout_s=1.0)
    start = time.perf_counter()
    with pytest.raises(RuntimeError):
        join_weight_group(spec, rank=0, store=store)
    assert time.perf_counter() - start < 10
    with pytest.raises(ValueError, match="weight group rank 2 outside"):
        join_weight_group(spec, rank=2, store=store)


class _WireEngine:
    """Stands in for an engine of one worker (engine worker ``worker_offset``), as ``rollout/vllm_worker.py``."""

    def __init__(self):
        self.link, self.received, self.fail = None, [], False

    def join_weight_group(self, spec, worker_offset):
        self.link = join_as_worker(WeightGroupSpec.from_dict(spec), worker_index=worker_offset)

    def receive_weights(self):
        for name, tensor in receive_weights(self.link.source, forward=self.link.forward):
            if self.fail:
                raise RuntimeError("worker crashed while loading")
            self.received.append((name, tensor.clone()))
        return [{"num_tensors": len(self.received)}]

    def generate(self, prompt_ids, n, sampling, prompt_indices=None):
        return []


def test_collective_sync_roles_and_a_failed_update_leaves_the_engine_unusable():
    engine = _WireEngine()
    placement = EnginePlacement(index=0, num_engines=1, leader_rank=0, ranks=(0,), devices=())
    guarded = GuardedEngine(engine, placement=placement, timeout_s=2.0)
    group, _ = connect_weight_group(engine=guarded, worker_offset=0, num_workers=1, backend="gloo", timeout_s=1.0,
                                 world=None, is_sender=True)  # fmt: skip
    sync = CollectiveWeightSync(engine=guarded, group=group, exporting=True, bucket_bytes=64, dtype=torch.float32)
    metrics = sync.sync(lambda: iter(_stream()))
    assert [name for name, _ in engine.received] == [name for name, _ in _stream()]
    assert metrics["sync/num_tensors"] == 5 and metrics["sync/megabytes"] == 4 * 427 / 2**20
    assert metrics["sync/gbytes_per_s"] > 0 and metrics["time/sync_s"] >= metrics["sync/broadcast_s"] > 0
    engine.fail, engine.received = True, []
    with pytest.raises(RuntimeError, match=r"engine 0 of 1 \(leader rank 0, ranks \[0\]\): weight update \(collective"
                                           r"\) failed \(RuntimeError: worker crashed while loading\)"):  # fmt: skip
        sync.sync(lambda: iter(_stream()))
    with pytest.raises(RuntimeError, match="engine 0 of 1 .* is unusable since a weight update failed half-way"):
        guarded.generate([[1]], 1, None)


def test_a_relay_feeds_the_worker_on_the_senders_gpu():
    """Colocated on GPUs (``plan.engines.relay_workers`` -> (1, 0)): worker 0 stays out of the main group and gets
    every bucket from worker 1; the same topology on gloo."""
    store = open_weight_store("127.0.0.1", world_size=3, timeout_s=10.0)
    spec = WeightGroupSpec(host="127.0.0.1", port=store.port, world_size=3, backend="gloo", timeout_s=10.0,
                           relay=(1, 0))  # fmt: skip
    spec = WeightGroupSpec.from_dict({**spec.as_dict(), "relay": [1, 0]})  # as an RPC hands it over
    with ThreadPoolExecutor(4) as pool:
        links = [pool.submit(join_as_worker, spec, worker_index=g) for g in range(3)]
        sender = join_weight_group(spec, rank=0, store=store)
        links = [f.result() for f in links]
    assert [(link.source.rank, link.source.size) for link in links] == [(1, 2), (1, 3), (2, 3)]
    assert links[1].forward.rank == 0 and links[0].forward is None and links[2].forward is None
    with ThreadPoolExecutor(3) as pool:
        received = [pool.submit(lambda k=k: [(n, t.clone()) for n, t in receive_weights(k.source, forward=k.forward)])
                    for k in links]  # fmt: skip
        send_weights(iter(_stream()), group=sender, bucket_bytes=64, dtype=torch.float32)
        for worker in received:
            got = worker.result()
            assert [n for n, _ in got] == [n for n, _ in _stream()]
            assert all(torch.equal(t, o) for (_, t), (_, o) in zip(got, _stream()))


def test_the_pipeline_holds_at_most_two_buckets_per_side():
    """A worker that is slow to load keeps the sender waiting: one bucket being loaded, one arriving, one packed."""
    sender, worker = _groups(2)
    stream = [(f"t{i}", torch.full((25,), float(i))) for i in range(6)]  # six 100-byte buckets (budget 200)
    with ThreadPoolExecutor(1) as pool:
        sending = pool.submit(send_weights, iter(stream), group=sender, bucket_bytes=200, dtype=torch.float32)
        stats = WireStats()
        received = receive_weights(worker, stats)
        first = next(received)
        time.sleep(0.5)  # vLLM busy with bucket 0
        assert not sending.done() and stats.transfer_s > 0
        rest = list(received)
        assert sending.result().num_buckets == 6
    assert [name for name, _ in [first, *rest]] == [name for name, _ in stream] and stats.num_buckets == 6


def test_a_worker_that_fails_while_loading_does_not_hold_up_the_sender():
    """vLLM's load raises after the first tensor: the rest of the update is received and dropped, so the sender
    finishes at once (not after the group's 60 s timeout) and the worker's error surfaces on its leader."""
    sender, worker = _groups(2, timeout_s=60.0)
    stream = [(f"t{i}", torch.ones(25)) for i in range(8)]

    def failing_load():
        for _name, _tensor in receive_weights(worker):
            raise ValueError("vLLM could not load t0")

    with ThreadPoolExecutor(1) as pool:
        loading = pool.submit(failing_load)
        start = time.perf_counter()
        assert send_weights(iter(stream), group=sender, bucket_bytes=200, dtype=torch.float32).num_buckets == 8
        assert time.perf_counter() - start < 10
        with pytest.raises(ValueError, match="could not load t0"):
            loading.result()
