"""Push trainer weights into the rollout engines in byte-bounded buckets (I/O only; no name mapping, no math).

The input is the stream that ``megatron_adapter.hf_stream`` yields: ``(hf_name, full_tensor)`` pairs in Hugging Face
(vLLM checkpoint) naming, already TP-gathered, PP-broadcast, vocab-trimmed and split out of fused QKV / gate-up.
Every rank of data-parallel replica 0's model-parallel group must drain it (its gathers are collectives).

``FilesWeightSync`` (``rollout.weight_sync: files``) pushes the buckets into rank 0's engine; ``CollectiveWeightSync``
(``collective``) has global rank 0 broadcast them over the weight group (``rollout/weight_wire.py``) to every engine
worker, each leader's engine receiving in a background thread (``rollout/engine_guard.py``). At most one bucket plus
one tensor is referenced at a time: about ``bucket_bytes`` extra memory on the sender. A leader whose engine fails
its receive (an error, its health check) says so on the group's side channel (``parallel/weight_group.py``), so the
sender and the other engines stop waiting within ``SIGNAL_POLL_S`` instead of the group's timeout.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gtpo_megatron.parallel.collectives import broadcast_object
from gtpo_megatron.parallel.weight_group import (
    SyncSignal,
    WeightGroup,
    WeightGroupSpec,
    abandon,
    join_weight_group,
    open_weight_store,
)
from gtpo_megatron.rollout.engine import NamedTensor, RolloutEngine
from gtpo_megatron.rollout.engine_guard import EngineCall
from gtpo_megatron.rollout.weight_wire import WireStats, send_weights

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from gtpo_megatron.rollout.engine_guard import GuardedEngine

StreamFactory = Callable[[], Iterable[NamedTensor]]

DEFAULT_BUCKET_BYTES = 256 * 2**20


@dataclass(frozen=True, slots=True)
class PushStats:
    """What one ``push_weights`` call moved (bytes in the arriving dtype; seconds of the push, reload included)."""

    num_tensors: int
    num_bytes: int
    num_buckets: int
    max_bucket_bytes: int
    seconds: float

    def as_metrics(self) -> dict[str, float]:
        """Flat metric names for the step log (``sync/*``)."""
        return {
            "sync/num_tensors": float(self.num_tensors),
            "sync/bytes": float(self.num_bytes),
            "sync/megabytes": self.num_bytes / 2**20,
            "sync/num_buckets": float(self.num_buckets),
            "sync/gbytes_per_s": self.num_bytes / 1e9 / max(self.seconds, 1e-9),
            "time/sync_s": self.seconds,
        }


def tensor_bytes(tensor) -> int:
    """Size of ``tensor``'s elements in bytes (``numel * element_size``)."""
    return tensor.numel() * tensor.element_size()


def iter_weight_buckets(named_tensors: Iterable[NamedTensor], *, bucket_bytes: int) -> Iterator[list[NamedTensor]]:
    """Consecutive buckets of at most ``bucket_bytes`` bytes, in order, lazily (a larger tensor travels alone).

    Raises:
        ValueError: ``bucket_bytes < 1``.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 1 (a byte budget per bucket, e.g. 256 MiB)")
    bucket: list[NamedTensor] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor_bytes(tensor)
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def push_weights(
    engine: RolloutEngine, named_tensors: Iterable[NamedTensor], *, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> PushStats:
    """Stream ``(hf_name, tensor)`` pairs (each name once) into the awake ``engine`` as one weight update.

    Raises:
        ValueError: ``bucket_bytes < 1``, or whatever the engine raises for a bad name or tensor; a failed push
            leaves the update unapplied (the next ``begin_weight_update`` discards it).
    """
    start = time.perf_counter()
    num_tensors = num_bytes = num_buckets = max_bucket = 0
    engine.begin_weight_update()
    for bucket in iter_weight_buckets(named_tensors, bucket_bytes=bucket_bytes):
        size = sum(tensor_bytes(t) for _, t in bucket)
        engine.load_weight_bucket(bucket)
        num_tensors += len(bucket)
        num_bytes += size
        num_buckets += 1
        max_bucket = max(max_bucket, size)
    engine.finish_weight_update()
    return PushStats(num_tensors, num_bytes, num_buckets, max_bucket, time.perf_counter() - start)


def drain(named_tensors: Iterable[NamedTensor]) -> None:
    """Consume a stream without keeping it (a rank that takes part in the gather but sends nothing)."""
    for _ in named_tensors:
        pass


class FilesWeightSync:
    """``rollout.weight_sync: files``: rank 0 (``engine`` set) stages the stream; other ``exporting`` ranks drain it."""

    def __init__(self, *, engine: RolloutEngine | None, exporting: bool, bucket_bytes: int) -> None:
        self.engine, self.exporting, self.bucket_bytes = engine, exporting, bucket_bytes

    def sync(self, stream: StreamFactory) -> dict[str, float]:
        """Push one update; returns the ``sync/*`` metrics on rank 0, ``{}`` elsewhere."""
        if self.engine is not None:
            return push_weights(self.engine, stream(), bucket_bytes=self.bucket_bytes).as_metrics()
        if self.exporting:
            drain(stream())
        return {}

    def stage(self, stream: StreamFactory) -> tuple[Callable[[], dict[str, float]], dict[str, float]]:
        """Gather one update now and load it later (``rollout/pipeline.py``: the weights queued between batches).

        Rank 0 keeps a host copy of every tensor until the load (one model's bytes); other exporting ranks drain.
        Returns the load (``push_weights``' metrics; a no-op off rank 0) and the gather's ``sync/bytes``,
        ``sync/megabytes`` and ``time/sync_s`` on rank 0 (``{}`` elsewhere).
        """
        if self.engine is None:
            if self.exporting:
                drain(stream())
            return dict, {}
        start = time.perf_counter()
        named = [(name, tensor.detach().to("cpu", copy=True)) for name, tensor in stream()]
        engine, bucket_bytes = self.engine, self.bucket_bytes
        num_bytes = sum(tensor_bytes(t) for _, t in named)
        metrics = {"sync/bytes": float(num_bytes), "sync/megabytes": num_bytes / 2**20,
                   "time/sync_s": time.perf_counter() - start}  # fmt: skip
        return lambda: push_weights(engine, named, bucket_bytes=bucket_bytes).as_metrics(), metrics


class CollectiveWeightSync:
    """``rollout.weight_sync: collective``: each rank's part of one update.

    ``engine``: this rank's guarded engine if it leads one; ``group``: the weight group on the sender (global rank
    0); ``exporting``: in the weight gather (DP rank 0); ``dtype``: the engines' weight dtype (the sender casts);
    ``signal``: the group's side channel on a leader (the sender's is ``group.signal``), None: failures unsaid.
    """

    def __init__(
        self,
        *,
        engine: GuardedEngine | None,
        group: WeightGroup | None,
        exporting: bool,
        bucket_bytes: int,
        dtype: torch.dtype,
        signal: SyncSignal | None = None,
    ) -> None:
        if group is not None and not exporting:
            raise ValueError("the weight group's sender must be a rank of the weight gather (global rank 0)")
        self.engine, self.group, self.exporting = engine, group, exporting
        self.bucket_bytes, self.dtype = bucket_bytes, dtype
        self.signal = signal if group is None else group.signal

    def sync(self, stream: StreamFactory) -> dict[str, float]:
        """One update: the sender broadcasts, every leader's engine receives, the gather's other ranks drain.

        Returns:
            On the sender ``sync/*``, ``time/sync_s`` and ``sync/broadcast_s`` (gather and broadcasts); else ``{}``.

        Raises:
            RuntimeError: a transfer or an engine failed or timed out (naming the engine); the engine is then
                unusable.
        """
        start = time.perf_counter()
        receiving = self._watch_receive() if self.engine is not None else None
        metrics: dict[str, float] = {}
        try:
            if self.group is not None:
                stats = self._send(stream)
                broadcast_s = time.perf_counter() - start
            elif self.exporting:
                drain(stream())
        finally:
            if receiving is not None:  # the watch ends within the engine's own bound (``GuardedEngine.wait``)
                receiving.result(2 * self.engine.timeout_s)
        if self.group is not None:
            seconds = time.perf_counter() - start
            push = PushStats(stats.num_tensors, stats.num_bytes, stats.num_buckets, stats.max_bucket_bytes, seconds)
            metrics = {**push.as_metrics(), "sync/broadcast_s": broadcast_s}
        return metrics

    def _watch_receive(self) -> EngineCall:
        """This leader's engine receiving one update, watched in a thread; ``result`` raises its failure.

        The failure is said on the side channel at once: the sender may be blocked on the failed engine meanwhile.
        """
        engine, signal, receiving = self.engine, self.signal, self.engine.start_receive()

        def watch():
            try:
                return engine.wait(receiving)
            except BaseException as err:
                if signal is not None:
                    signal.fail(f"{engine.name} failed during the weight update ({type(err).__name__}: {err})")
                raise

        return EngineCall(watch, "watching the weight update")

    def _send(self, stream: StreamFactory) -> WireStats:
        """``send_weights`` on the group; a failed send abandons the group (``weight_group.abandon``).

        A member that died leaves the group broken; the side channel has told the other members (``send_weights``),
        and destroying the group now would wait for its broadcasts still in flight.
        """
        try:
            return send_weights(stream(), group=self.group, bucket_bytes=self.bucket_bytes, dtype=self.dtype)
        except BaseException as err:
            err.add_note("".join(traceback.format_tb(err.__traceback__)))  # the frames keep the group: dropped
            err.__traceback__ = None
            abandon(self.group)
            self.group = None
            raise


def connect_weight_group(
    *,
    engine: GuardedEngine | None,
    worker_offset: int,
    num_workers: int,
    backend: str,
    timeout_s: float,
    world: dist.ProcessGroup | None,
    is_sender: bool,
    relay: tuple[int, int] | None = None,
) -> tuple[WeightGroup | None, SyncSignal | None]:
    """Build the weight group (every rank of ``world``); returns ``(group, None)`` on the sender.

    A leader that is not the sender gets ``(None, its side channel)``; other ranks ``(None, None)``.

    ``worker_offset``: the index of this engine's first worker among ``num_workers``; ``relay``:
    ``plan.engines.relay_workers``. Collectives: one object broadcast on ``world``, then the group's rendezvous.

    Raises:
        RuntimeError: a member did not join within ``timeout_s`` (naming the engine when it is this rank's).
    """
    store, spec = None, None
    if is_sender:
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        size = 1 + num_workers - (relay is not None)
        store = open_weight_store(host, world_size=size, timeout_s=timeout_s)
        spec = WeightGroupSpec(
            host=host, port=store.port, world_size=size, backend=backend, timeout_s=timeout_s, relay=relay
        ).as_dict()
    spec = broadcast_object(spec, src=0, group=world)
    joining = engine.start_join(spec, worker_offset) if engine is not None else None
    spec = WeightGroupSpec.from_dict(spec)
    try:
        group = join_weight_group(spec, rank=0, store=store) if is_sender else None
    finally:
        if joining is not None:
            engine.wait(joining, breaks_weights=False)
    signal = SyncSignal.connect(spec) if engine is not None and group is None else None
    return group, signal
