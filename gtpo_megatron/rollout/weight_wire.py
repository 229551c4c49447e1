"""The bucket protocol of the collective weight sync: the sender's side and the engine workers' side.

The sender (global rank 0, member 0 of the weight group, ``parallel/weight_group.py``) packs the stream of
``(hf_name, full_tensor)`` pairs into a reused byte buffer of ``bucket_bytes`` (each tensor cast to the engines'
dtype while it is copied in, so the buffer plus one tensor of the stream is all the extra memory) and broadcasts
each full bucket as three messages:

1. ``sizes``: int64 ``[2]`` = (header bytes, payload bytes); ``(0, 0)`` ends the update and ``(-1, 0)`` aborts it
   (the sender's stream failed: the workers raise at once instead of waiting for the group's timeout);
2. ``header``: uint8 UTF-8 JSON ``{"dtype": "bfloat16", "tensors": [[name, shape, byte_offset], ...]}``;
3. ``payload``: uint8 ``[payload bytes]``, the tensors back to back (one dtype, so every offset is aligned).

A tensor larger than the bucket travels alone in a buffer of its own size. Every worker turns the messages back
into ``(name, tensor)`` views of its payload (:func:`receive_weights`), which vLLM's ``reload_weights`` consumes in
one pass; a payload stays alive only while vLLM's layerwise reload still holds views of a layer it has not
completed. All messages go through ``parallel.collectives.broadcast_buffer`` with the group's timeout.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from gtpo_megatron.parallel.collectives import broadcast_buffer
from gtpo_megatron.parallel.weight_group import WeightGroup
from gtpo_megatron.rollout.engine import NamedTensor

SENDER = 0


@dataclass
class WireStats:
    """What one update moved (filled while the stream runs).

    Attributes:
        num_tensors: tensors sent or received.
        num_bytes: payload bytes (in the engines' dtype).
        num_buckets: buckets.
        max_bucket_bytes: the largest payload.
        transfer_s: seconds spent inside the broadcasts (the rest is packing, or vLLM's reload on a worker).
    """

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


def _broadcast(
    buffers: list[torch.Tensor], group: WeightGroup, stats: WireStats | None, forward: WeightGroup | None = None
) -> None:
    """Broadcast ``buffers`` in order from member 0, each passed on to ``forward`` (a relay), timed in ``stats``."""
    start = time.perf_counter()
    for buffer in buffers:
        broadcast_buffer(buffer, root=SENDER, group=group)
        if forward is not None:
            broadcast_buffer(buffer, root=SENDER, group=forward)
    if stats is not None:
        stats.transfer_s += time.perf_counter() - start


def _send_bucket(
    payload: torch.Tensor, entries: list, dtype: torch.dtype, group: WeightGroup, stats: WireStats
) -> None:
    header = json.dumps({"dtype": str(dtype).removeprefix("torch."), "tensors": entries}).encode()
    header_tensor = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(group.device)
    sizes = torch.tensor([len(header), payload.numel()], dtype=torch.int64, device=group.device)
    _broadcast([sizes, header_tensor, payload], group, stats)
    stats.add_bucket(len(entries), payload.numel())


def _aborting(named_tensors: Iterable[NamedTensor], group: WeightGroup) -> Iterator[NamedTensor]:
    """The stream; when it raises, the workers are told to abort (one broadcast) before the error propagates."""
    stream = iter(named_tensors)
    while True:
        try:
            item = next(stream)
        except StopIteration:
            return
        except BaseException:
            _broadcast([torch.tensor([-1, 0], dtype=torch.int64, device=group.device)], group, None)
            raise
        yield item


def send_weights(
    named_tensors: Iterable[NamedTensor], *, group: WeightGroup, bucket_bytes: int, dtype: torch.dtype
) -> WireStats:
    """Broadcast a whole update from the sender (member 0); every worker must run :func:`receive_weights`.

    Args:
        named_tensors: ``(hf_name, full_tensor)`` pairs, each name once; not modified.
        group: the joined weight group (this process is member 0).
        bucket_bytes: byte budget of one bucket (>= 1).
        dtype: the engines' weight dtype; tensors are cast while they are packed.

    Returns:
        ``WireStats`` of the update.

    Collectives: three broadcasts per bucket and one to end, on ``group`` (``parallel.collectives``).

    Raises:
        ValueError: ``bucket_bytes < 1`` or this process is not member 0.
        RuntimeError: a worker died or timed out (``group.timeout_s``).
        BaseException: whatever the stream raised, after the workers were told to abort.
    """
    if bucket_bytes < 1 or group.rank != SENDER:
        raise ValueError(f"send_weights needs bucket_bytes >= 1 (got {bucket_bytes}) on member 0 (got {group.rank})")
    element = torch.empty((), dtype=dtype).element_size()
    buffer = torch.empty(bucket_bytes, dtype=torch.uint8, device=group.device)
    stats, entries, used = WireStats(), [], 0
    for name, tensor in _aborting(named_tensors, group):
        nbytes = tensor.numel() * element
        if entries and used + nbytes > bucket_bytes:
            _send_bucket(buffer[:used], entries, dtype, group, stats)
            entries, used = [], 0
        target = buffer if nbytes <= bucket_bytes else torch.empty(nbytes, dtype=torch.uint8, device=group.device)
        target[used : used + nbytes].view(dtype).copy_(tensor.detach().reshape(-1))
        entries.append([name, list(tensor.shape), used])
        used += nbytes
        if target is not buffer:  # an oversized tensor travels alone
            _send_bucket(target, entries, dtype, group, stats)
            entries, used = [], 0
    if entries:
        _send_bucket(buffer[:used], entries, dtype, group, stats)
    _broadcast([torch.zeros(2, dtype=torch.int64, device=group.device)], group, stats)
    return stats


def receive_weights(
    group: WeightGroup, stats: WireStats | None = None, *, forward: WeightGroup | None = None
) -> Iterator[NamedTensor]:
    """Yield the ``(hf_name, tensor)`` pairs of one update as the sender's buckets arrive (an engine worker).

    Tensors are views of the bucket they came in (on ``group.device``, in the sender's dtype); the generator ends
    with the sender's end message. ``stats`` (optional) is filled as buckets arrive. A relay
    (``parallel.weight_group.WorkerLink``) passes every message on to ``forward``, where it is member 0, so the
    worker there receives the same update with this function.

    Collectives: the receiving side of :func:`send_weights` on ``group`` (member 0 sends), plus the same
    broadcasts as sender on ``forward``.

    Raises:
        RuntimeError: the sender aborted, died or timed out (``group.timeout_s``); the update is then incomplete.
    """
    while True:
        sizes = torch.zeros(2, dtype=torch.int64, device=group.device)
        _broadcast([sizes], group, stats, forward)
        header_bytes, payload_bytes = (int(v) for v in sizes.tolist())
        if header_bytes == 0:
            return
        if header_bytes < 0:
            raise RuntimeError("the sender aborted the weight update half-way (its weight stream failed)")
        header = torch.empty(header_bytes, dtype=torch.uint8, device=group.device)
        payload = torch.empty(payload_bytes, dtype=torch.uint8, device=group.device)
        _broadcast([header, payload], group, stats, forward)
        meta = json.loads(header.cpu().numpy().tobytes())
        dtype = getattr(torch, meta["dtype"])
        element = torch.empty((), dtype=dtype).element_size()
        for name, shape, offset in meta["tensors"]:
            nbytes = math.prod(shape) * element
            yield name, payload[offset : offset + nbytes].view(dtype).view(shape)
        if stats is not None:
            stats.add_bucket(len(meta["tensors"]), payload_bytes)
