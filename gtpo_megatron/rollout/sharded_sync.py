"""``rollout.weight_sync: sharded``: every training rank sends the pieces it owns straight to every engine worker.

No gather (docs/scaling.md, "Weight sync"). No engine serves a mix of old and new weights: each leader's
``GuardedEngine`` waits for its workers' one ``reload_weights`` pass, and any sender, worker or load failing
half-way raises (naming the sender, its trainer rank and the tensors) and leaves that engine unusable.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

import torch

from gtpo_megatron.parallel.collectives import all_gather_object, all_reduce_, broadcast_object
from gtpo_megatron.parallel.weight_group import WeightGroup, WeightGroupSpec, join_weight_group, open_weight_store
from gtpo_megatron.rollout.engine_slices import EngineGeometry, tensor_slices
from gtpo_megatron.rollout.shard_plan import Offer, ShardPlan, build_shard_plan
from gtpo_megatron.rollout.sharded_wire import send_shards

if TYPE_CHECKING:
    import torch.distributed as dist

    from gtpo_megatron.rollout.engine_guard import GuardedEngine

PieceSource = Callable[[], tuple[list[Offer], Mapping[tuple[str, int], torch.Tensor]]]
"""This rank's ``(offers, (hf_name, part) -> view)`` (``MegatronPolicy.shard_pieces``)."""


def element_size(dtype: torch.dtype) -> int:
    """Bytes of one ``dtype`` value."""
    return torch.empty((), dtype=dtype).element_size()


def sync_metrics(plan: ShardPlan, *, num_workers: int, dtype: torch.dtype, seconds: float) -> dict[str, float]:
    """``sync/*`` of one update: the model's bytes, the busiest sender's bytes (over all workers), ``seconds``.

    On engines at TP > 1 a worker receives only its slice, so the bytes sent are about the model's per engine.
    """
    element, engines = element_size(dtype), num_workers // plan.engine_tp_size
    total = sum(math.prod(t.shape) for t in plan.tensors) * element
    sent = plan.sender_elements(engines)
    busiest = max(sent) * element
    return {
        "sync/num_tensors": float(len(plan.tensors)),
        "sync/bytes": float(total),
        "sync/megabytes": total / 2**20,
        "sync/num_buckets": float(len(plan.buckets)),
        "sync/num_senders": float(len(plan.senders)),
        "sync/busiest_sender_megabytes": busiest / 2**20,
        "sync/gbytes_per_s": sum(sent) * element / 1e9 / max(seconds, 1e-9),
        "time/sync_s": seconds,
    }


class ShardedWeightSync:
    """One rank's part of a sharded update (every rank of the trainer's world calls :meth:`sync`).

    ``engine``: this rank's guarded engine if it leads one; ``group``: the weight group if this rank is a sender;
    ``world``: the trainer's world (None: one process).
    """

    def __init__(
        self,
        *,
        engine: GuardedEngine | None,
        group: WeightGroup | None,
        plan: ShardPlan,
        pieces: PieceSource,
        num_workers: int,
        dtype: torch.dtype,
        world: dist.ProcessGroup | None,
    ) -> None:
        self.engine, self.group, self.plan, self.pieces = engine, group, plan, pieces
        self.num_workers, self.dtype, self.world = num_workers, dtype, world

    def sync(self, stream: Callable[[], Iterable] | None = None) -> dict[str, float]:
        """One update (``stream``, the gathered one, is not used); ``sync/*`` metrics on global rank 0, else ``{}``.

        ``sync/engine_pause_s``: the longest reload pass of any worker (its engine generates nothing meanwhile).
        Collectives: :func:`sharded_wire.send_shards` on a sender, then one MAX all-reduce of ``[seconds, pause]``
        on ``world`` (the sync takes as long as its slowest rank).

        Raises:
            RuntimeError: a transfer or an engine failed or timed out (naming the sender, rank and tensors).
        """
        start, workers = time.perf_counter(), []
        receiving = self.engine.start_receive() if self.engine is not None else None
        try:
            if self.group is not None:
                send_shards(self.plan, self._own_pieces(), group=self.group, num_workers=self.num_workers,
                            dtype=self.dtype)  # fmt: skip
        finally:
            if receiving is not None:
                workers = self.engine.wait(receiving)
        pause = max((w["seconds"] for w in workers), default=0.0)
        slowest = all_reduce_(torch.tensor([time.perf_counter() - start, pause]), op="max", group=self.world)
        if self.group is None or self.group.rank != 0:
            return {}
        metrics = sync_metrics(self.plan, num_workers=self.num_workers, dtype=self.dtype, seconds=slowest[0].item())
        return {**metrics, "sync/engine_pause_s": slowest[1].item()}

    def _own_pieces(self) -> Mapping[tuple[str, int], torch.Tensor]:
        """This rank's pieces; if listing them fails, a mapping that raises it, so the workers get an abort."""
        try:
            return self.pieces()[1]
        except Exception as err:  # noqa: BLE001 - re-raised by send_shards after the abort
            return _Failed(err)


class _Failed(dict):
    """Pieces that could not be listed: every lookup raises the original error."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error

    def __getitem__(self, key):
        raise self.error


def connect_sharded_sync(
    *,
    engine: GuardedEngine | None,
    pieces: PieceSource,
    rank: int,
    worker_offset: int,
    num_workers: int,
    bucket_bytes: int,
    dtype: torch.dtype,
    timeout_s: float,
    world: dist.ProcessGroup | None,
    engines: EngineGeometry | None = None,
) -> ShardedWeightSync:
    """Plan the sync and build its weight group once at start-up (every rank of ``world``; ``rank``: global).

    ``engines``: the model's geometry on engines at TP > 1 (each worker then receives only its slice,
    ``engine_slices``); None: every worker receives every tensor whole.

    Collectives: one ``all_gather_object`` of the offers and one object broadcast on ``world``, then the weight
    group's rendezvous (the senders and every engine worker).

    Raises:
        ValueError: the offers leave a slice of a tensor unsent (``build_shard_plan``).
        RuntimeError: a member did not join within ``timeout_s``.
    """
    tp_size = 1 if engines is None else engines.tp_size
    plan = build_shard_plan(all_gather_object(pieces()[0], group=world), bucket_bytes=bucket_bytes,
                            element_size=element_size(dtype), engine_tp_size=tp_size,
                            slicer=lambda name, shape: tensor_slices(name, shape, engines))  # fmt: skip
    store, spec = None, None
    if rank == 0:
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        size = len(plan.senders) + num_workers
        store = open_weight_store(host, world_size=size, timeout_s=timeout_s)
        spec = WeightGroupSpec(host=host, port=store.port, world_size=size, backend="gloo", timeout_s=timeout_s,
                               num_senders=len(plan.senders)).as_dict()  # fmt: skip
    spec = WeightGroupSpec.from_dict(broadcast_object(spec, src=0, group=world))
    joining = engine.start_join(spec.as_dict(), worker_offset) if engine is not None else None
    group = None
    try:
        if rank in plan.senders:
            group = join_weight_group(spec, rank=plan.senders.index(rank), store=store)
    finally:
        if joining is not None:
            engine.wait(joining, breaks_weights=False)
    return ShardedWeightSync(engine=engine, group=group, plan=plan, pieces=pieces, num_workers=num_workers,
                             dtype=dtype, world=world)  # fmt: skip
