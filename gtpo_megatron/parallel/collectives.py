"""Every collective the package issues itself, over explicit process groups (torch only: no package imports).

Primitives, the step's global statistics (loss normaliser, <H>_ini's mean) and control messages (stop flags, resume
choice); the weight gather (``megatron_adapter/hf_stream``) is the one other caller of ``torch.distributed``.
A tensor collective runs on its group's device (:func:`group_device`) and returns on the input's device; object
collectives and barriers let torch choose. ``group=None`` means "this process is the whole group" (no collective is
issued), never the default world. No collective is differentiable; inputs are not modified unless the name ends in _.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


SIGNAL_POLL_S = 0.2
"""How often :func:`wait_broadcast` reads a weight group's side channel while a broadcast is outstanding."""


class BroadcastGroup(Protocol):
    """A process group built outside the default world with its own timeout (``parallel/weight_group.py``)."""

    pg: dist.ProcessGroup
    timeout: timedelta

    def failure(self) -> str | None:
        """Why the group's update in flight was given up (its side channel), or None."""


class SyncAbandoned(RuntimeError):
    """A weight group's update was given up by another party (the side channel's reason is in the message)."""


def group_device(group: dist.ProcessGroup) -> torch.device:
    """The device of ``group``'s tensor collectives: the current CUDA device when it has an NCCL backend, else CPU."""
    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_(tensor: torch.Tensor, *, op: Literal["sum", "max"], group: dist.ProcessGroup | None) -> torch.Tensor:
    """Reduce ``tensor`` over ``group`` in place (one SUM or MAX all-reduce); returns it."""
    if group is None:
        return tensor
    device = group_device(group)
    work = tensor if tensor.device == device else tensor.to(device)
    dist.all_reduce(work, op=_REDUCE_OPS[op], group=group)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def all_reduce_sum(tensor: torch.Tensor, *, group: dist.ProcessGroup | None) -> torch.Tensor:
    """A copy of ``tensor`` summed over ``group`` (one SUM all-reduce), on ``tensor``'s device."""
    return all_reduce_(tensor.detach().clone(), op="sum", group=group)


def broadcast_(tensor: torch.Tensor, *, src: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Overwrite ``tensor`` (same shape and dtype on every rank) with global rank ``src``'s copy; one broadcast."""
    if group is None:
        return tensor
    device = group_device(group)
    work = tensor if tensor.device == device else tensor.to(device)
    dist.broadcast(work, src=src, group=group)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def all_gather_rows(
    local: torch.Tensor, *, group: dist.ProcessGroup | None, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """``[B]`` fp32 of the batch from each rank's ``[B/size]`` share; one SUM all-reduce of a zero-padded vector.

    ``rows``: ``[B/size]`` int64, where this rank's values go (the ranks' rows partition the batch); None: the
    contiguous share ``[rank * B/size, (rank + 1) * B/size)``.
    """
    rank, size = (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))
    full = torch.zeros(local.shape[0] * size, dtype=torch.float32)
    share = local.shape[0]
    full[slice(rank * share, (rank + 1) * share) if rows is None else rows] = local
    return all_reduce_sum(full, group=group)


def all_gather_tensors(tensor: torch.Tensor, *, group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (one shape and dtype on all) in rank order, on ``tensor``'s device; one all_gather."""
    if group is None:
        return [tensor.detach()]
    device = group_device(group)
    work = tensor.detach().to(device).contiguous()
    out = [torch.empty_like(work) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, work, group=group)
    return [piece.to(tensor.device) for piece in out]


def broadcast_object(obj: Any, *, src: int, group: dist.ProcessGroup | None) -> Any:
    """Picklable ``obj`` of global rank ``src`` on every rank (others pass anything); one ``broadcast_object_list``."""
    if group is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_gather_object(obj: Any, *, group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's picklable ``obj`` in rank order, on every rank; one ``all_gather_object``."""
    if group is None:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def barrier(*, group: dist.ProcessGroup | None) -> None:
    """Wait until every rank of ``group`` got here (one barrier)."""
    if group is not None:
        dist.barrier(group=group)


def any_rank(flag: bool, *, group: dist.ProcessGroup | None) -> bool:
    """True on every rank when ``flag`` is True on at least one; one MAX all-reduce of a 1-element tensor."""
    return bool(all_reduce_(torch.tensor([1.0 if flag else 0.0]), op="max", group=group).item())


def global_normalizer(local_normalizer: torch.Tensor, *, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The step's loss normaliser: ``ops.compute_normalizer`` of this rank's rows summed over the DP ``group``.

    Returns an fp32 scalar (0 when no rank has a response token). Collectives: one SUM all-reduce.
    """
    return all_reduce_sum(local_normalizer.float(), group=group)


def global_mean(values: torch.Tensor, *, group: dist.ProcessGroup | None, mask: torch.Tensor | None = None):
    """Mean of ``values`` ``[n]`` (where ``mask`` is True) over all ranks (``<H>_ini``, docs/algorithm.md section 4).

    Returns an fp32 scalar, 0 when nothing is selected. Collectives: one SUM all-reduce of (sum, count).
    """
    keep = torch.ones_like(values, dtype=torch.bool) if mask is None else mask.bool()
    stats = torch.stack([values.detach().float()[keep].sum(), keep.sum(dtype=torch.float32)])
    stats = all_reduce_sum(stats, group=group)
    return stats[0] / stats[1].clamp(min=1.0)


def reduce_metric_sums(
    metrics: Mapping[str, torch.Tensor], *, group: dist.ProcessGroup | None
) -> dict[str, torch.Tensor]:
    """Sum scalar metric tensors (same keys on every rank) over ``group``; returns fp32 scalars by key.

    Collectives: one SUM all-reduce of a ``[len(metrics)]`` vector (keys sorted, so the order cannot differ).
    """
    keys = sorted(metrics)
    if not keys:
        return {}
    stacked = torch.stack([metrics[k].detach().float().reshape(()) for k in keys])
    summed = all_reduce_sum(stacked, group=group)
    return {k: summed[i] for i, k in enumerate(keys)}


def start_broadcast(buffer: torch.Tensor, *, root: int, group: BroadcastGroup) -> dist.Work:
    """Start broadcasting ``buffer`` in place from member ``root`` of a weight group; ``wait()`` the returned work.

    Receivers' ``buffer`` (contiguous, on ``group.device``) is filled; ``root``'s is read. Broadcasts on one group
    complete in the order started. Collectives: one broadcast on ``group.pg`` with the group's timeout.
    """
    options = dist.BroadcastOptions()
    options.rootRank = root
    options.rootTensor = 0
    options.timeout = group.timeout
    return group.pg.broadcast([buffer], options)


def wait_broadcast(work: dist.Work, *, group: BroadcastGroup) -> None:
    """Wait for a :func:`start_broadcast`, reading ``group.failure()`` every ``SIGNAL_POLL_S`` meanwhile.

    The broadcast ends by itself at the group's timeout; a timed ``wait`` that expires leaves it running on gloo, so
    waiting in slices costs nothing and a failure said on the side channel ends the wait within one slice. NCCL's
    timed wait would abort its communicator: there it is one plain wait (no side channel; untested on CPU).

    Raises:
        SyncAbandoned: the side channel says the update failed (the broadcast is left in flight: abandon the group).
        RuntimeError: a member died or did not take part within the group's timeout (the group is then unusable).
    """
    if not isinstance(group.pg, dist.ProcessGroupGloo):
        work.wait()
        return
    poll = timedelta(seconds=SIGNAL_POLL_S)
    while True:
        try:
            work.wait(poll)
            return
        except RuntimeError:
            if work.is_completed():  # it failed, or it completed just after the slice expired: its own result
                work.wait()
                return
        reason = group.failure()
        if reason is not None:
            raise SyncAbandoned(f"the weight update was abandoned: {reason}")


def broadcast_buffer(buffer: torch.Tensor, *, root: int, group: BroadcastGroup) -> None:
    """:func:`start_broadcast` and :func:`wait_broadcast` for it (raises as that does)."""
    wait_broadcast(start_broadcast(buffer, root=root, group=group), group=group)


def start_send(buffer: torch.Tensor, *, dst: int, tag: int, group: BroadcastGroup) -> dist.Work:
    """Start sending ``buffer`` (contiguous, on the group's device) to member ``dst`` of a weight group.

    Messages between two members with one ``tag`` arrive in the order sent. Collectives: one point-to-point send on
    ``group.pg``; :func:`wait_work` for it.
    """
    return group.pg.send([buffer], dst, tag)


def start_recv(buffer: torch.Tensor, *, src: int, tag: int, group: BroadcastGroup) -> dist.Work:
    """Start receiving member ``src``'s message of ``tag`` into ``buffer`` (its size); :func:`wait_work` for it."""
    return group.pg.recv([buffer], src, tag)


def wait_work(work: dist.Work, *, group: BroadcastGroup) -> None:
    """Wait for a :func:`start_send` / :func:`start_recv` at most ``group.timeout``.

    Raises:
        RuntimeError: the peer died or did not take part within the timeout.
    """
    work.wait(group.timeout)
