"""Faults on either side of the weight wire end the update at once, not after the weight group's timeout.

Two gloo members (threads of this process, as ``test_weight_wire.py``) with a 3 s timeout; each test measures the
time from the injected fault to the error (printed) and requires well under the timeout.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from gtpo_megatron.parallel.weight_group import WorkerLink, abandon
from gtpo_megatron.rollout import weight_wire
from gtpo_megatron.rollout.vllm_worker import WeightReloadExtension
from gtpo_megatron.rollout.weight_wire import receive_weights, send_weights
from tests.distributed.test_weight_wire import _groups

pytestmark = pytest.mark.distributed

TIMEOUT_S = 3.0
FAST_S = 1.0  # an abort arrives in milliseconds; the old behaviour was the whole TIMEOUT_S


def _drain(group):
    return [name for name, _ in receive_weights(group)]


@pytest.mark.parametrize("where", ["add", "flush"])
def test_a_packing_failure_aborts_the_workers(monkeypatch, where):
    """The second ``add`` (a failing cast or copy) or the final flush raises on the sender."""
    sender, worker = _groups(2, timeout_s=TIMEOUT_S)
    fault = {}
    real = getattr(weight_wire._Sender, where)

    def failing(self, *args):
        if where == "flush" or self.entries:
            fault["at"] = time.perf_counter()
            raise MemoryError(f"injected {where} failure")
        return real(self, *args)

    monkeypatch.setattr(weight_wire._Sender, where, failing)
    stream = [("a", torch.ones(4)), ("b", torch.ones(4))]  # one 32-byte bucket (budget 64)
    with ThreadPoolExecutor(1) as pool:
        received = pool.submit(_drain, worker)
        with pytest.raises(MemoryError, match=f"injected {where} failure"):
            send_weights(iter(stream), group=sender, bucket_bytes=64, dtype=torch.float32)
        with pytest.raises(RuntimeError, match="the sender aborted the weight update half-way"):
            received.result()
        elapsed = time.perf_counter() - fault["at"]
    print(f"[wire] {where} failure -> worker error after {elapsed:.3f} s (timeout {TIMEOUT_S} s)")
    assert elapsed < FAST_S


class _StopRace(threading.Event):
    """Forces the receive thread's stop check for the second bucket to pass just before the consumer stops."""

    armed = False

    def is_set(self) -> bool:
        if threading.current_thread().name == "gtpo-weights" and _StopRace.armed:
            _StopRace.armed = False
            self.wait(TIMEOUT_S)  # the check said "running"; the consumer stops now
            time.sleep(0.2)  # and has dropped what it held before the thread goes on
            return False
        return super().is_set()


def test_a_consumer_that_stops_during_the_handover_releases_the_thread(monkeypatch):
    sender, worker = _groups(2, timeout_s=TIMEOUT_S)
    real_receive = weight_wire._receive_bucket
    received = []

    def receive(group, forward):
        bucket = real_receive(group, forward)
        received.append(bucket)
        _StopRace.armed = len(received) == 2
        return bucket

    monkeypatch.setattr(weight_wire, "_receive_bucket", receive)
    monkeypatch.setattr(weight_wire.threading, "Event", _StopRace)
    stream = [(f"t{i}", torch.ones(25)) for i in range(4)]  # four 100-byte buckets (budget 200)
    with ThreadPoolExecutor(1) as pool:
        sending = pool.submit(send_weights, iter(stream), group=sender, bucket_bytes=200, dtype=torch.float32)
        updates = receive_weights(worker)
        next(updates)
        fault = time.perf_counter()
        updates.close()  # vLLM's load failed on t0
        assert sending.result().num_buckets == 4
        elapsed = time.perf_counter() - fault
    print(f"[wire] consumer stopped during the handover -> sender done after {elapsed:.3f} s")
    assert elapsed < FAST_S
    for thread in [t for t in threading.enumerate() if t.name == "gtpo-weights"]:
        thread.join(FAST_S)  # receiving the end message
        assert not thread.is_alive()
    assert len(received) == 5  # four buckets and the end message, all taken off the wire


class _Worker(WeightReloadExtension):
    """A vLLM worker whose load fails on the first tensor (the failing frame keeps the iterator referenced)."""

    def reload_weights(self, weights_iterator):
        next(weights_iterator)
        self.fault = time.perf_counter()
        raise ValueError("vLLM could not load t0")


def _timed_send(sender, stream):
    stats = send_weights(iter(stream), group=sender, bucket_bytes=200, dtype=torch.float32)
    return stats, time.perf_counter()


def test_a_failed_vllm_load_releases_the_sender():
    sender, worker = _groups(2, timeout_s=TIMEOUT_S)
    engine_worker = _Worker()
    engine_worker._gtpo_weight_link = WorkerLink(worker)
    stream = [(f"t{i}", torch.ones(25)) for i in range(4)]
    with ThreadPoolExecutor(2) as pool:
        loading = pool.submit(engine_worker.gtpo_receive_weights)
        sending = pool.submit(_timed_send, sender, stream)
        with pytest.raises(ValueError, match="could not load t0") as failure:
            loading.result()  # the failure (and its traceback, with the iterator) stays alive meanwhile
        stats, done = sending.result()
    elapsed = done - engine_worker.fault
    print(f"[wire] vLLM load failure -> sender done after {elapsed:.3f} s")
    assert stats.num_buckets == 4 and elapsed < FAST_S and failure.value is not None


def test_a_failed_collective_sync_tells_the_workers_on_the_side_channel(monkeypatch):
    """The abort message cannot be sent either (a member died): the group's side channel ends the workers' receive
    (the sender's group is abandoned, not destroyed: that would wait for its broadcasts in flight)."""
    from gtpo_megatron.rollout.push import CollectiveWeightSync

    groups = _groups(2, timeout_s=30.0)  # a worker still waiting at this timeout would fail the match below
    worker = groups.pop()
    sync = CollectiveWeightSync(engine=None, group=groups.pop(), exporting=True, bucket_bytes=64, dtype=torch.float32)

    def abort(self):
        raise RuntimeError("injected: Connection closed by peer (the dead member)")

    def stream():
        yield "a", torch.ones(4)
        yield "b", torch.ones(4)
        raise OSError("injected: a member died")

    monkeypatch.setattr(weight_wire._Sender, "abort", abort)
    with ThreadPoolExecutor(1) as pool:
        received = pool.submit(_drain, worker)
        with pytest.raises(OSError, match="a member died"):
            sync.sync(stream)
        assert sync.group is None
        with pytest.raises(RuntimeError, match=r"abandoned: the sender failed \(OSError: injected: a member died\)"):
            received.result()
    # as the engine worker does with a replaced link: its broadcast is still in flight, and a group collected with
    # work in flight blocks the whole process (GIL held) until the group's timeout
    abandon(worker)
