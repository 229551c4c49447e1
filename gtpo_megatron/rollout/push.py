"""Push trainer weights into a rollout engine in byte-bounded buckets (I/O only; no name mapping, no math).

The input is the stream that ``megatron_adapter.hf_stream`` yields: ``(hf_name, full_tensor)`` pairs in Hugging Face
(vLLM checkpoint) naming, already TP-gathered, PP-broadcast, vocab-trimmed and split out of fused QKV / gate-up.
``push_weights`` groups the stream into buckets of at most ``bucket_bytes`` (a single tensor larger than the budget
travels alone), hands each bucket to ``RolloutEngine.load_weight_bucket`` between ``begin_weight_update`` and
``finish_weight_update``, and returns timing and volume statistics for the step metrics. At most one bucket plus
one tensor of the stream is referenced at a time, so peak extra memory is about ``bucket_bytes``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from gtpo_megatron.rollout.engine import NamedTensor, RolloutEngine

DEFAULT_BUCKET_BYTES = 256 * 2**20


@dataclass(frozen=True, slots=True)
class PushStats:
    """What one ``push_weights`` call moved.

    Attributes:
        num_tensors: tensors handed to the engine.
        num_bytes: their total size in bytes, in the dtype they arrived in.
        num_buckets: buckets handed to the engine.
        max_bucket_bytes: size of the largest bucket in bytes.
        seconds: wall time of the whole push, engine reload included.
    """

    num_tensors: int
    num_bytes: int
    num_buckets: int
    max_bucket_bytes: int
    seconds: float

    def as_metrics(self) -> dict[str, float]:
        """Flat metric names for the step log (``sync/*``)."""
        return {
            "sync/num_tensors": float(self.num_tensors),
            "sync/megabytes": self.num_bytes / 2**20,
            "sync/num_buckets": float(self.num_buckets),
            "time/sync_s": self.seconds,
        }


def tensor_bytes(tensor) -> int:
    """Size of ``tensor``'s elements in bytes (``numel * element_size``)."""
    return tensor.numel() * tensor.element_size()


def iter_weight_buckets(named_tensors: Iterable[NamedTensor], *, bucket_bytes: int) -> Iterator[list[NamedTensor]]:
    """Group a stream of named tensors into consecutive buckets of at most ``bucket_bytes`` bytes.

    Order is preserved; a tensor larger than the budget forms a bucket of its own. The stream is consumed lazily.

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
    """Stream ``named_tensors`` into ``engine`` as one weight update.

    Args:
        engine: the rollout engine (awake: call ``wake_up`` first if it sleeps).
        named_tensors: ``(hf_name, full_tensor)`` pairs, each name once; tensors are not modified.
        bucket_bytes: byte budget per bucket.

    Returns:
        ``PushStats`` of the update. After return the engine generates with the new weights.

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
