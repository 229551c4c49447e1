"""The weight sync as the bytes its busiest link carries: ``collective`` against ``sharded`` (pure arithmetic).

With ``M`` the model's bytes in the engines' dtype, ``W = num_engines * engine_tp_size`` engine workers and ``T``
training ranks (every rank holds ``M / T`` of the pieces once data-parallel copies share the sending, as
``rollout/shard_plan.py`` assigns them), a link of ``B`` bit/s and the time ``max(sender, receiver) * 8 / B``:

* ``collective``: rank 0 broadcasts everything, pipelined: its link and each worker's carry ``M``;
* ``sharded`` (as built: every worker gets full tensors, vLLM slices them): the busiest sender carries ``M W / T``,
  each worker ``M``;
* ``sliced`` (not built: each worker of an engine at TP ``t`` would receive only its slice): the busiest sender
  carries ``M * num_engines / T``, each worker ``M / t``.

Piece granularity (a rank's share is whole tensor slices) and the gathers the collective path runs first are left
out; the measured figures are ``benchmarks/bench_sharded_sync.py``'s.
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
    model_bytes: float, *, train_ranks: int, num_engines: int, engine_tp_size: int, bandwidth_gbps: float
) -> dict[str, SyncLinks]:
    """``{"collective", "sharded", "sliced"}`` -> :class:`SyncLinks` (module docstring); bandwidth in Gbit/s.

    Raises:
        ValueError: a count < 1 or a bandwidth <= 0.
    """
    if min(train_ranks, num_engines, engine_tp_size) < 1 or bandwidth_gbps <= 0:
        raise ValueError(
            f"train_ranks={train_ranks}, num_engines={num_engines}, engine_tp_size={engine_tp_size} must be >= 1 "
            f"and bandwidth_gbps={bandwidth_gbps} > 0"
        )
    workers = num_engines * engine_tp_size
    return {
        "collective": _links(model_bytes, model_bytes, bandwidth_gbps),
        "sharded": _links(model_bytes * workers / train_ranks, model_bytes, bandwidth_gbps),
        "sliced": _links(model_bytes * num_engines / train_ranks, model_bytes / engine_tp_size, bandwidth_gbps),
    }
