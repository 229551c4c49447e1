"""A process group of its own for weight updates: the trainer's sender and every vLLM engine worker.

The group is built from a ``TCPStore`` and a ``ProcessGroupGloo`` (CPU) or ``ProcessGroupNCCL`` (GPU) constructed
directly, so it is never registered with ``torch.distributed``'s default world: neither the trainer's world (the
torchrun ranks) nor the engines' own world (vLLM's workers of one engine) is touched, and the two can live in one
process. vLLM's weight-transfer engines, verl and NeMo-RL build their trainer<->engine groups the same way (a
stateless store plus a communicator); here the communicator is torch's own process group, so gloo works on CPU.

Ranks: the sender (global rank 0 of the trainer) is rank 0; engine worker ``g`` (``g = i * engine_tp_size + w``
for worker ``w`` of engine ``i``) is rank ``1 + g``. Rank 0 hosts the store (:func:`open_weight_store` picks a free
port); the others connect to ``host:port``. Every collective on the group carries ``timeout_s``, so a dead or hung
member makes the others fail within that time instead of waiting forever. The collectives themselves are in
``parallel/collectives.py`` (:func:`~gtpo_megatron.parallel.collectives.broadcast_buffer`).

Relay (``plan.engines.relay_workers``): NCCL refuses two members of one communicator on the same GPU, and a
colocated engine 0 puts its worker 0 on the sender's GPU. That worker (the relay's *target*) then stays out of the
main group, whose worker ranks close up (worker ``g > target`` is rank ``g``), and joins a two-member relay group
with another worker (the *relay*, rank 0 there) that passes on every buffer it receives. The same topology runs on
gloo, which is how it is tested here. The NCCL backend itself is UNTESTED (no GPU on the development machine).
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
        world_size: members of the main group: 1 sender + every engine worker (but a relay's target).
        backend: ``"gloo"`` (CPU tensors) or ``"nccl"`` (CUDA tensors).
        timeout_s: timeout of the rendezvous and of every collective, seconds.
        relay: ``(relay, target)`` engine-worker indices when a relay feeds the target (module docstring).
    """

    host: str
    port: int
    world_size: int
    backend: Literal["gloo", "nccl"]
    timeout_s: float
    relay: tuple[int, int] | None = None

    def as_dict(self) -> dict[str, Any]:
        """Plain values, for RPC arguments (:meth:`from_dict` reads them back)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> WeightGroupSpec:
        """The spec of :meth:`as_dict` (an RPC may have turned the relay pair into a list)."""
        relay = values.get("relay")
        return cls(**{**values, "relay": tuple(relay) if relay is not None else None})


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


@dataclass(frozen=True, slots=True)
class WorkerLink:
    """An engine worker's place in the weight groups.

    ``source``: where its buckets come from (member 0 sends); ``forward``: for the relay only, the group it passes
    every received buffer on to (as member 0).
    """

    source: WeightGroup
    forward: WeightGroup | None = None


def join_weight_group(
    spec: WeightGroupSpec, *, rank: int, store: dist.Store | None = None, relay_group: bool = False
) -> WeightGroup:
    """Join the main group (or, with ``relay_group``, the two-member relay group) as ``rank``.

    Blocks until every member joined, at most ``timeout_s`` (NCCL connects at the first collective instead).

    Args:
        spec: the group's address, size, backend and timeout.
        rank: this member's rank (module docstring).
        store: the sender's own store from :func:`open_weight_store`; None connects to ``spec.host:spec.port``.
        relay_group: join the relay group (size 2) instead of the main one.

    Raises:
        ValueError: ``rank`` outside the group.
        RuntimeError: the rendezvous timed out (a member never joined).
    """
    size = 2 if relay_group else spec.world_size
    if not 0 <= rank < size:
        raise ValueError(f"weight group rank {rank} outside [0, {size})")
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    if store is None:
        store = dist.TCPStore(spec.host, spec.port, spec.world_size, is_master=False, timeout=timeout)
    prefixed = dist.PrefixStore(f"{_PREFIX}-relay" if relay_group else _PREFIX, store)
    if spec.backend == "nccl":  # UNTESTED: no GPU here
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefixed, rank, size, options)
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        pg = dist.ProcessGroupGloo(prefixed, rank, size, timeout)
        device = torch.device("cpu")
    return WeightGroup(pg, rank, size, device, spec.timeout_s)


def join_as_worker(spec: WeightGroupSpec, *, worker_index: int) -> WorkerLink:
    """Join as engine worker ``worker_index`` (``i * engine_tp_size + w``): main group, relay group or both."""
    if spec.relay is None:
        return WorkerLink(join_weight_group(spec, rank=1 + worker_index))
    relay, target = spec.relay
    if worker_index == target:
        return WorkerLink(join_weight_group(spec, rank=1, relay_group=True))
    main = join_weight_group(spec, rank=worker_index + (worker_index < target))
    forward = join_weight_group(spec, rank=0, relay_group=True) if worker_index == relay else None
    return WorkerLink(main, forward)
