"""A process group of its own for weight updates: the trainer's sender and every vLLM engine worker.

The group is built from a ``TCPStore`` and a ``ProcessGroupGloo`` (CPU) or ``ProcessGroupNCCL`` (GPU) constructed
directly, so it is never registered with ``torch.distributed``'s default world: neither the trainer's world (the
torchrun ranks) nor the engines' own world (vLLM's workers of one engine) is touched, and the two can live in one
process. vLLM's weight-transfer engines, verl and NeMo-RL build their trainer<->engine groups the same way (a
stateless store plus a communicator); here the communicator is torch's own process group, so gloo works on CPU.

Ranks: the sender (global rank 0 of the trainer) is rank 0; worker ``w`` of engine ``i`` is rank
``1 + i * engine_tp_size + w``. Rank 0 hosts the store (:func:`open_weight_store` picks a free port); the others
connect to ``host:port``. Every collective on the group carries ``timeout_s``, so a dead or hung member makes the
others fail within that time instead of waiting forever. The collectives themselves are in
``parallel/collectives.py`` (:func:`~gtpo_megatron.parallel.collectives.broadcast_buffer`).

NCCL: built for engines whose GPUs the sender does not use (``placement: separate``); NCCL refuses two ranks of one
communicator on the same GPU. UNTESTED here (no GPU on the development machine).
"""

from __future__ import annotations

import datetime
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

_PREFIX = "gtpo-weights"


@dataclass(frozen=True, kw_only=True, slots=True)
class WeightGroupSpec:
    """How to join the weight group (sent to the engine workers as a plain dict, see :meth:`as_dict`).

    Attributes:
        host: address of the store (the sender's host).
        port: port of the store.
        world_size: 1 sender + every engine worker.
        backend: ``"gloo"`` (CPU tensors) or ``"nccl"`` (CUDA tensors).
        timeout_s: timeout of the rendezvous and of every collective, seconds.
    """

    host: str
    port: int
    world_size: int
    backend: Literal["gloo", "nccl"]
    timeout_s: float

    def as_dict(self) -> dict[str, Any]:
        """Plain values, for RPC arguments."""
        return asdict(self)


@dataclass(frozen=True, slots=True)
class WeightGroup:
    """A joined weight group: the process group, this member's rank, where its buffers live, its timeout."""

    pg: dist.ProcessGroup
    rank: int
    size: int
    device: torch.device
    timeout_s: float

    @property
    def timeout(self) -> datetime.timedelta:
        """``timeout_s`` as a ``timedelta`` (the form torch's options take)."""
        return datetime.timedelta(seconds=self.timeout_s)


def open_weight_store(host: str, *, world_size: int, timeout_s: float) -> dist.TCPStore:
    """The store server on the sender (rank 0), on a free port (``store.port``); members join later."""
    return dist.TCPStore(
        host,
        0,
        world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def join_weight_group(spec: WeightGroupSpec, *, rank: int, store: dist.Store | None = None) -> WeightGroup:
    """Join the group as ``rank`` (blocks until all ``spec.world_size`` members joined, at most ``timeout_s``).

    Args:
        spec: the group's address, size, backend and timeout.
        rank: this member's rank (module docstring).
        store: the sender's own store from :func:`open_weight_store`; None connects to ``spec.host:spec.port``.

    Raises:
        ValueError: ``rank`` outside ``[0, world_size)``.
        RuntimeError: the rendezvous timed out (a member never joined).
    """
    if not 0 <= rank < spec.world_size:
        raise ValueError(f"weight group rank {rank} outside [0, {spec.world_size})")
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    if store is None:
        store = dist.TCPStore(spec.host, spec.port, spec.world_size, is_master=False, timeout=timeout)
    prefixed = dist.PrefixStore(_PREFIX, store)
    if spec.backend == "nccl":  # UNTESTED: no GPU here
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefixed, rank, spec.world_size, options)
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        pg = dist.ProcessGroupGloo(prefixed, rank, spec.world_size, timeout)
        device = torch.device("cpu")
    return WeightGroup(pg, rank, spec.world_size, device, spec.timeout_s)
