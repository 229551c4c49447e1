"""A process group of its own for weight updates: the trainer's sender and every vLLM engine worker.

A ``TCPStore`` plus a ``ProcessGroupGloo`` (CPU) or ``ProcessGroupNCCL`` (GPU) constructed directly, never
registered with ``torch.distributed``'s default world, so the trainer's world and an engine's own workers are left
untouched (the pattern of vLLM's weight-transfer engines, verl and NeMo-RL). Every collective carries ``timeout_s``;
they live in ``parallel/collectives.py``.

Ranks: the sender (trainer rank 0, which hosts the store) is 0; engine worker ``g = i * engine_tp_size + w`` is
``1 + g``. Relay (``plan.engines.relay_workers``): NCCL refuses two members on one GPU, so the colocated worker on
the sender's GPU (the *target*) leaves the main group (later workers' ranks close up) and is fed by another worker
(the *relay*) through a two-member relay group. Sharded (``num_senders`` > 0, ``rollout/sharded_wire.py``): members
``0 .. num_senders-1`` are training ranks, worker ``g`` is ``num_senders + g``, no relay. Tested on gloo; the NCCL
path is not run on CPU. Side channel (``SyncSignal``): docs/training.md, "Engine failures".
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

_PREFIX = "gtpo-weights"
_FAILED_KEY = "gtpo-weights-update-failed"
ABANDON_MARGIN_S = 5.0
"""Seconds past a group's timeout before :func:`abandon` drops it (its work in flight has failed by then)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class WeightGroupSpec:
    """How to join the weight group (sent to the engine workers as a plain dict, see :meth:`as_dict`).

    ``world_size`` counts the sender and every worker but a relay's target; ``timeout_s`` in seconds; ``relay`` is
    the ``(relay, target)`` worker pair, if any.
    """

    host: str
    port: int
    world_size: int
    backend: Literal["gloo", "nccl"]
    timeout_s: float
    relay: tuple[int, int] | None = None
    num_senders: int = 0

    def as_dict(self) -> dict[str, Any]:
        """Plain values, for RPC arguments (:meth:`from_dict` reads them back)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> WeightGroupSpec:
        """The spec of :meth:`as_dict` (an RPC may have turned the relay pair into a list)."""
        relay = values.get("relay")
        return cls(**{**values, "relay": tuple(relay) if relay is not None else None})


@dataclass(frozen=True, slots=True)
class SyncSignal:
    """The weight group's side channel (module docstring): its store, shared by the members and engine leaders."""

    store: dist.Store

    @classmethod
    def connect(cls, spec: WeightGroupSpec) -> SyncSignal:
        """A client of the sender's store (an engine leader that is not a member of the group)."""
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        return cls(dist.TCPStore(spec.host, spec.port, spec.world_size, is_master=False, timeout=timeout))

    def fail(self, reason: str) -> None:
        """Say that the update in flight failed (the first reason is kept); best effort: a gone store is ignored."""
        with contextlib.suppress(RuntimeError):  # the sender's process is gone: nobody is left waiting on it
            self.store.compare_set(_FAILED_KEY, "", reason)

    def failure(self) -> str | None:
        """The reason the update failed, or None while nobody said so (an unreachable store is a failure)."""
        try:
            return self.store.get(_FAILED_KEY).decode() if self.store.check([_FAILED_KEY]) else None
        except RuntimeError as err:
            return f"the weight group's store is unreachable ({err})"


@dataclass(frozen=True, slots=True)
class WeightGroup:
    """A joined weight group: process group, rank, buffer device, timeout, side channel (None: timeout only)."""

    pg: dist.ProcessGroup
    rank: int
    size: int
    device: torch.device
    timeout_s: float
    signal: SyncSignal | None = None

    @property
    def timeout(self) -> datetime.timedelta:
        """``timeout_s`` as a ``timedelta`` (the form torch's options take)."""
        return datetime.timedelta(seconds=self.timeout_s)

    def failure(self) -> str | None:
        """Why the update in flight failed (``SyncSignal.failure``), or None."""
        return None if self.signal is None else self.signal.failure()


def abandon(group: WeightGroup | None) -> None:
    """Drop ``group`` in a daemon thread after its timeout + margin (destroying it with work in flight blocks)."""
    if group is None:
        return
    held, delay_s = [group], group.timeout_s + ABANDON_MARGIN_S

    def release() -> None:
        time.sleep(delay_s)
        held.clear()

    threading.Thread(target=release, name="gtpo-abandoned-weight-group", daemon=True).start()


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
    """An engine worker's groups: ``source`` sends it buckets; ``forward`` (the relay only) is where it passes them.

    ``sharded``: ``source`` speaks the sharded protocol (many senders) instead of the collective one.
    """

    source: WeightGroup
    forward: WeightGroup | None = None
    sharded: bool = False


def join_weight_group(
    spec: WeightGroupSpec, *, rank: int, store: dist.Store | None = None, relay_group: bool = False
) -> WeightGroup:
    """Join the main group (or the two-member relay group) as ``rank``; blocks at most ``timeout_s`` on gloo.

    ``store``: the sender's own store; None connects to ``spec.host:spec.port``.

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
    return WeightGroup(pg, rank, size, device, spec.timeout_s, SyncSignal(store))


def join_as_worker(spec: WeightGroupSpec, *, worker_index: int) -> WorkerLink:
    """Join as engine worker ``worker_index`` (``i * engine_tp_size + w``): main group, relay group or both."""
    if spec.num_senders:
        return WorkerLink(join_weight_group(spec, rank=spec.num_senders + worker_index), sharded=True)
    if spec.relay is None:
        return WorkerLink(join_weight_group(spec, rank=1 + worker_index))
    relay, target = spec.relay
    if worker_index == target:
        return WorkerLink(join_weight_group(spec, rank=1, relay_group=True))
    main = join_weight_group(spec, rank=worker_index + (worker_index < target))
    forward = join_weight_group(spec, rank=0, relay_group=True) if worker_index == relay else None
    return WorkerLink(main, forward)
