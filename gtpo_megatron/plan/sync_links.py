"""The weight sync as the bytes its busiest link carries: ``collective`` and ``sharded``.

The model (``M`` bytes, ``T`` training ranks, ``N`` engines at TP ``t``; time = busiest link's bytes * 8 /
bandwidth) is derived in docs/scaling.md ("Weight sync"); ``sharded`` sends each worker only its engine-TP slice
(``rollout/engine_slices.py``; norms, whole, are ignored). The measured figures are
``benchmarks/bench_sharded_sync.py``'s.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SyncLinks:
    """One path's busiest sender and receiver (bytes per sync) and its seconds at the assumed bandwidth."""

    sender_bytes: float
    receiver_bytes: float
    seconds: float


def _links(sender: float, receiver: float, bandwidth_gbps: float) -> SyncLinks:
    return SyncLinks(sender, receiver, max(sender, receiver) * 8 / (bandwidth_gbps * 1e9))


def sync_links(
    model_bytes: float,
    *,
    train_ranks: int,
    num_engines: int,
    engine_tp_size: int,
    bandwidth_gbps: float,
) -> dict[str, SyncLinks]:
    """``{"collective", "sharded"}`` -> :class:`SyncLinks` (module docstring); bandwidth in Gbit/s.

    Raises:
        ValueError: a count < 1 or a bandwidth <= 0.
    """
    if min(train_ranks, num_engines, engine_tp_size) < 1 or bandwidth_gbps <= 0:
        raise ValueError(
            f"train_ranks={train_ranks}, num_engines={num_engines}, engine_tp_size={engine_tp_size} must be >= 1 "
            f"and bandwidth_gbps={bandwidth_gbps} > 0"
        )
    return {
        "collective": _links(model_bytes, model_bytes, bandwidth_gbps),
        "sharded": _links(model_bytes * num_engines / train_ranks, model_bytes / engine_tp_size, bandwidth_gbps),
    }
