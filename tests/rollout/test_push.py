"""Byte-bounded bucketing and the push protocol (begin, buckets, finish), with a recording engine; no vLLM."""

from __future__ import annotations

import pytest
import torch

from gtpo_megatron.rollout.push import PushStats, iter_weight_buckets, push_weights


def _stream(sizes_bytes: list[int]) -> list[tuple[str, torch.Tensor]]:
    """fp32 tensors whose byte sizes are ``sizes_bytes`` (multiples of 4)."""
    return [(f"w{i}", torch.full((size // 4,), float(i))) for i, size in enumerate(sizes_bytes)]


class RecordingEngine:
    """Records the weight-update calls it receives (the subset of RolloutEngine that push uses)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[str]]] = []

    def begin_weight_update(self) -> None:
        self.calls.append(("begin", []))

    def load_weight_bucket(self, bucket) -> None:
        self.calls.append(("bucket", [name for name, _ in bucket]))

    def finish_weight_update(self) -> None:
        self.calls.append(("finish", []))


def test_buckets_written_out_by_hand():
    # budget 100 bytes: [40, 40] fit (80), +40 would be 120 -> new bucket; 200 alone (oversized); then [8, 8].
    stream = _stream([40, 40, 40, 200, 8, 8])
    buckets = list(iter_weight_buckets(stream, bucket_bytes=100))
    assert [[n for n, _ in b] for b in buckets] == [["w0", "w1"], ["w2"], ["w3"], ["w4", "w5"]]
    for bucket in buckets:  # tensors are passed through, not copied
        for name, tensor in bucket:
            assert tensor is dict(stream)[name]


def test_budget_is_respected_except_for_single_oversized_tensors():
    sizes = [4 * int(s) for s in torch.randint(1, 60, (200,))]
    buckets = list(iter_weight_buckets(_stream(sizes), bucket_bytes=120))
    assert [n for b in buckets for n, _ in b] == [f"w{i}" for i in range(len(sizes))]
    for bucket in buckets:
        total = sum(t.numel() * 4 for _, t in bucket)
        assert total <= 120 or len(bucket) == 1
    for left, right in zip(buckets, buckets[1:]):  # greedy: the next tensor did not fit
        assert sum(t.numel() * 4 for _, t in left) + right[0][1].numel() * 4 > 120


def test_stream_is_consumed_lazily():
    pulled: list[str] = []

    def gen():
        for name, tensor in _stream([40] * 10):
            pulled.append(name)
            yield name, tensor

    buckets = iter_weight_buckets(gen(), bucket_bytes=80)
    first = next(buckets)
    assert [n for n, _ in first] == ["w0", "w1"]
    assert pulled == ["w0", "w1", "w2"]  # one look-ahead tensor, never the whole model


def test_push_protocol_and_stats():
    engine = RecordingEngine()
    stats = push_weights(engine, _stream([40, 40, 40, 200]), bucket_bytes=100)
    assert engine.calls == [
        ("begin", []),
        ("bucket", ["w0", "w1"]),
        ("bucket", ["w2"]),
        ("bucket", ["w3"]),
        ("finish", []),
    ]
    assert isinstance(stats, PushStats)
    assert (stats.num_tensors, stats.num_bytes, stats.num_buckets, stats.max_bucket_bytes) == (4, 320, 3, 200)
    assert stats.as_metrics()["sync/num_buckets"] == 3.0


def test_failed_push_does_not_finish():
    class Failing(RecordingEngine):
        def load_weight_bucket(self, bucket) -> None:
            raise ValueError("bad tensor")

    engine = Failing()
    with pytest.raises(ValueError, match="bad tensor"):
        push_weights(engine, _stream([40]), bucket_bytes=100)
    assert engine.calls == [("begin", [])]


def test_bad_budget():
    with pytest.raises(ValueError, match="bucket_bytes=0"):
        list(iter_weight_buckets(_stream([4]), bucket_bytes=0))
