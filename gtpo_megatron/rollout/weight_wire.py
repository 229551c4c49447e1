"""The bucket protocol of the collective weight sync: the sender's side and the engine workers' side.

The sender (member 0 of the weight group, ``parallel/weight_group.py``) packs ``(hf_name, full_tensor)`` pairs
into buckets, cast to the engines' dtype while copied in, and broadcasts each bucket as three messages:

1. ``sizes``: int64 ``[2]`` = (header bytes, payload bytes); ``(0, 0)`` ends the update, ``(-1, 0)`` aborts it
   (any failure on the sender's side: the workers raise at once instead of after the group's timeout);
2. ``header``: uint8 UTF-8 JSON ``{"dtype": "bfloat16", "tensors": [[name, shape, byte_offset], ...]}``;
3. ``payload``: uint8, the tensors back to back (one dtype, so every offset is aligned).

Pipelining: the sender packs the next bucket while the previous one is broadcast, and each worker receives the
next bucket in a thread while vLLM loads the current one, so each side holds two half-``bucket_bytes`` buckets.
A tensor larger than a bucket travels alone. All messages go through ``parallel.collectives`` with the group's
timeout.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from gtpo_megatron.parallel.collectives import broadcast_buffer, start_broadcast, wait_broadcast
from gtpo_megatron.parallel.weight_group import WeightGroup
from gtpo_megatron.rollout.engine import NamedTensor

SENDER = 0


@dataclass
class WireStats:
    """What one update moved; ``transfer_s``: seconds waiting for broadcasts (a worker: vLLM waiting for buckets)."""

    num_tensors: int = 0
    num_bytes: int = 0
    num_buckets: int = 0
    max_bucket_bytes: int = 0
    transfer_s: float = 0.0

    def add_bucket(self, num_tensors: int, num_bytes: int) -> None:
        """Count one bucket."""
        self.num_tensors += num_tensors
        self.num_bytes += num_bytes
        self.num_buckets += 1
        self.max_bucket_bytes = max(self.max_bucket_bytes, num_bytes)


def _relayed(buffer: torch.Tensor, group: WeightGroup, forward: WeightGroup | None) -> None:
    """Receive ``buffer`` from member 0 and pass it on to ``forward`` (a relay's second group) when given."""
    broadcast_buffer(buffer, root=SENDER, group=group)
    if forward is not None:
        broadcast_buffer(buffer, root=SENDER, group=forward)


def _control(values: list[int], group: WeightGroup) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=group.device)


class _Sender:
    """The sender's two half-bucket buffers and the broadcasts of the bucket in flight."""

    def __init__(self, group: WeightGroup, bucket_bytes: int, dtype: torch.dtype) -> None:
        self.group, self.dtype, self.stats = group, dtype, WireStats()
        self.capacity = max(bucket_bytes // 2, 1)
        self.element = torch.empty((), dtype=dtype).element_size()
        self.buffers = [torch.empty(self.capacity, dtype=torch.uint8, device=group.device) for _ in range(2)]
        self.current, self.entries, self.used, self.in_flight = 0, [], 0, []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Pack one tensor (sending the bucket first when it would overflow)."""
        nbytes = tensor.numel() * self.element
        if self.entries and self.used + nbytes > self.capacity:
            self.flush()
        if nbytes > self.capacity:  # travels alone, as itself when it can
            same = tensor.dtype == self.dtype and tensor.is_contiguous() and tensor.device == self.group.device
            payload = tensor.detach().reshape(-1).view(torch.uint8) if same else self._cast(tensor, nbytes)
            self._send(payload, [[name, list(tensor.shape), 0]])
            return
        buffer = self.buffers[self.current]
        buffer[self.used : self.used + nbytes].view(self.dtype).copy_(tensor.detach().reshape(-1))
        self.entries.append([name, list(tensor.shape), self.used])
        self.used += nbytes

    def _cast(self, tensor: torch.Tensor, nbytes: int) -> torch.Tensor:
        payload = torch.empty(nbytes, dtype=torch.uint8, device=self.group.device)
        payload.view(self.dtype).copy_(tensor.detach().reshape(-1))
        return payload

    def flush(self) -> None:
        """Send the packed bucket (if any) and switch to the other buffer."""
        if self.entries:
            self._send(self.buffers[self.current][: self.used], self.entries)
            self.current, self.entries, self.used = 1 - self.current, [], 0

    def _send(self, payload: torch.Tensor, entries: list) -> None:
        self.wait()  # the other buffer's bucket: at most one bucket in flight while the next one is packed
        header = json.dumps({"dtype": str(self.dtype).removeprefix("torch."), "tensors": entries}).encode()
        header_tensor = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(self.group.device)
        messages = [_control([len(header), payload.numel()], self.group), header_tensor, payload]
        self.in_flight = [(m, start_broadcast(m, root=SENDER, group=self.group)) for m in messages]
        self.stats.add_bucket(len(entries), payload.numel())

    def wait(self) -> None:
        """Wait for the bucket in flight (its buffers may be reused afterwards)."""
        start = time.perf_counter()
        for _, work in self.in_flight:
            wait_broadcast(work, group=self.group)
        self.in_flight = []
        self.stats.transfer_s += time.perf_counter() - start

    def end(self) -> None:
        """Wait for the last bucket, then send the end message."""
        self.wait()
        broadcast_buffer(_control([0, 0], self.group), root=SENDER, group=self.group)

    def abort(self) -> None:
        """Tell the workers to drop the update (best effort: not when the bucket in flight failed to arrive)."""
        self.wait()
        broadcast_buffer(_control([-1, 0], self.group), root=SENDER, group=self.group)


def send_weights(
    named_tensors: Iterable[NamedTensor], *, group: WeightGroup, bucket_bytes: int, dtype: torch.dtype
) -> WireStats:
    """Broadcast ``(hf_name, full_tensor)`` pairs from member 0, cast to ``dtype``; returns the ``WireStats``.

    Every worker runs :func:`receive_weights`. ``bucket_bytes``: budget of the two buckets in flight.
    Collectives: three asynchronous broadcasts per bucket (one bucket outstanding) and one to end, on ``group``.

    Raises:
        ValueError: ``bucket_bytes < 2`` or this process is not member 0.
        RuntimeError: a worker died or timed out (``group.timeout_s``); ``SyncAbandoned`` when the group's side
            channel says the update failed (``parallel/weight_group.py``).
        BaseException: whatever the stream, the packing or a send raised, after the workers were told to abort
            (by the abort message, or on the side channel when the wire itself failed).
    """
    if bucket_bytes < 2 or group.rank != SENDER:
        raise ValueError(f"send_weights needs bucket_bytes >= 2 (got {bucket_bytes}) on member 0 (got {group.rank})")
    sender = _Sender(group, bucket_bytes, dtype)
    try:
        for name, tensor in named_tensors:
            sender.add(name, tensor)
        sender.flush()
    except BaseException as err:
        try:
            sender.abort()
        except Exception as abort_err:  # the wire itself failed: the side channel tells the workers
            err.add_note(f"the abort message could not be sent either: {abort_err!r}")
            _say_failed(group, err)
        raise
    try:
        sender.end()
    except BaseException as err:
        _say_failed(group, err)
        raise
    return sender.stats


def _say_failed(group: WeightGroup, err: BaseException) -> None:
    if group.signal is not None:
        group.signal.fail(f"the sender failed ({type(err).__name__}: {err})")


def _receive_bucket(group: WeightGroup, forward: WeightGroup | None) -> tuple[dict, torch.Tensor] | None:
    """One bucket's ``(header, payload)``, or None at the end; ``RuntimeError`` if the sender aborted or died."""
    sizes = _control([0, 0], group)
    _relayed(sizes, group, forward)
    header_bytes, payload_bytes = (int(v) for v in sizes.tolist())
    if header_bytes == 0:
        return None
    if header_bytes < 0:
        raise RuntimeError("the sender aborted the weight update half-way (its error is in the trainer log)")
    header = torch.empty(header_bytes, dtype=torch.uint8, device=group.device)
    payload = torch.empty(payload_bytes, dtype=torch.uint8, device=group.device)
    _relayed(header, group, forward)
    _relayed(payload, group, forward)
    return json.loads(header.cpu().numpy().tobytes()), payload


class _Handoff:
    """The one-bucket slot between the receive thread and the consumer; a stop releases the thread at any time."""

    def __init__(self) -> None:
        self.stopped = threading.Event()
        self._changed = threading.Condition()
        self._items: list = []

    def put(self, item) -> None:
        """Hand ``item`` over and wait until it is taken or the consumer stopped (then it is dropped)."""
        with self._changed:
            if self.stopped.is_set():
                return
            self._items.append(item)
            self._changed.notify_all()
            self._changed.wait_for(lambda: not self._items or self.stopped.is_set())

    def get(self):
        """The next item (consumer side)."""
        with self._changed:
            self._changed.wait_for(lambda: self._items)
            item = self._items.pop()
            self._changed.notify_all()
            return item

    def stop(self) -> None:
        """The consumer stopped: drop what was handed over and release the thread."""
        self.stopped.set()
        with self._changed:
            self._items.clear()
            self._changed.notify_all()


def _prefetch(group: WeightGroup, forward: WeightGroup | None, out: _Handoff) -> None:
    """Receive bucket after bucket into ``out`` (two alive at most); after a stop, receive and drop the rest."""
    if group.device.type == "cuda":  # UNTESTED: no GPU here
        torch.cuda.set_device(group.device)
    try:
        while True:
            bucket = _receive_bucket(group, forward)
            out.put(bucket)
            if bucket is None:
                return
    except BaseException as err:  # handed to the consumer
        out.put(err)


def receive_weights(
    group: WeightGroup, stats: WireStats | None = None, *, forward: WeightGroup | None = None
) -> Iterator[NamedTensor]:
    """Yield the ``(hf_name, tensor)`` pairs of one update as the buckets arrive (an engine worker).

    Tensors are views of their bucket (``group.device``, the sender's dtype); ``stats`` is filled as they arrive.
    A relay passes every message on to ``forward`` (as its member 0). Close the generator when the load fails, so
    the rest of the update is dropped at once. Collectives: :func:`send_weights`'s, received, and sent on ``forward``.

    Raises:
        RuntimeError: the sender aborted, died or timed out (``group.timeout_s``); the update is then incomplete.
    """
    stats = stats if stats is not None else WireStats()
    buckets = _Handoff()
    threading.Thread(target=_prefetch, args=(group, forward, buckets), name="gtpo-weights", daemon=True).start()
    try:
        while True:
            start = time.perf_counter()
            bucket = buckets.get()
            stats.transfer_s += time.perf_counter() - start
            if bucket is None:
                return
            if isinstance(bucket, BaseException):
                raise bucket
            meta, payload = bucket
            dtype = getattr(torch, meta["dtype"])
            element = torch.empty((), dtype=dtype).element_size()
            for name, shape, offset in meta["tensors"]:
                nbytes = math.prod(shape) * element
                yield name, payload[offset : offset + nbytes].view(dtype).view(shape)
            stats.add_bucket(len(meta["tensors"]), payload.numel())
    finally:  # stopped early (vLLM's load raised): let the thread drop the rest of the update
        buckets.stop()
