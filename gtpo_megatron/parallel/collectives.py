"""Every collective the package issues itself, over explicit process groups (torch only: no package imports).

Primitives, the step's global statistics (the loss normaliser, <H>_ini's step mean: statistics apart from the
decisions that use them) and the trainer's control messages (stop flags, the resume choice). The ops layer's
log-prob op issues its TP all-reduces through :func:`all_reduce_`; the weight gather (``megatron_adapter/hf_stream``)
is the one other caller of ``torch.distributed`` (``tests/distributed/test_collective_device.py``).

Devices: a tensor collective runs on its group's device (:func:`group_device`: the current CUDA device for an NCCL
group, the ``cuda:nccl`` half of ``cpu:gloo,cuda:nccl`` included; else the CPU); results come back on the input's
device. Object collectives and barriers let torch choose (gloo's CPU when the group has it).

``group=None`` means "this process is the whole group", never the default world. No collective is differentiable.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


class BroadcastGroup(Protocol):
    """A process group built outside the default world with its own timeout (``parallel/weight_group.py``)."""

    pg: dist.ProcessGroup
    timeout: timedelta


def group_device(group: dist.ProcessGroup) -> torch.device:
    """The device of ``group``'s tensor collectives: the current CUDA device when it has an NCCL backend, else CPU."""
    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_(tensor: torch.Tensor, *, op: Literal["sum", "max"], group: dist.ProcessGroup | None) -> torch.Tensor:
    """Reduce ``tensor`` over ``group`` IN PLACE (moved to the group's device for the collective); returns it.

    For buffers the caller owns (the log-prob op's statistics, metric totals); :func:`all_reduce_sum` returns a copy.

    Collectives: one all-reduce (``op``: SUM or MAX) on ``group`` (none when ``group`` is None).
    """
    if group is None:
        return tensor
    device = group_device(group)
    work = tensor if tensor.device == device else tensor.to(device)
    dist.all_reduce(work, op=_REDUCE_OPS[op], group=group)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def all_reduce_sum(tensor: torch.Tensor, *, group: dist.ProcessGroup | None) -> torch.Tensor:
    """A copy of ``tensor`` summed over ``group``, on ``tensor``'s device (the input is not modified).

    Collectives: one SUM all-reduce on ``group`` (none when ``group`` is None).
    """
    return all_reduce_(tensor.detach().clone(), op="sum", group=group)


def broadcast_(tensor: torch.Tensor, *, src: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Overwrite ``tensor`` with global rank ``src``'s copy on every rank of ``group`` (in place); returns it.

    Every rank passes a tensor of the same shape and dtype (the receivers' values are ignored).

    Collectives: one broadcast on ``group`` (none when ``group`` is None).
    """
    if group is None:
        return tensor
    device = group_device(group)
    work = tensor if tensor.device == device else tensor.to(device)
    dist.broadcast(work, src=src, group=group)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def all_gather_rows(local: torch.Tensor, *, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``[B]`` fp32 from each rank's ``[B/size]`` share, concatenated in rank order, identical on every rank.

    Collectives: one SUM all-reduce of a zero-padded ``[B]`` vector on ``group`` (none when ``group`` is None).
    """
    rank, size = (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))
    full = torch.zeros(local.shape[0] * size, dtype=torch.float32)
    share = local.shape[0]
    full[rank * share : (rank + 1) * share] = local
    return all_reduce_sum(full, group=group)


def broadcast_object(obj: Any, *, src: int, group: dist.ProcessGroup | None) -> Any:
    """``obj`` of global rank ``src`` on every rank of ``group`` (picklable; other ranks pass anything, e.g. None).

    Collectives: one ``broadcast_object_list`` on ``group`` (none when ``group`` is None).
    """
    if group is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_gather_object(obj: Any, *, group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order of ``group``, on every rank.

    Collectives: one ``all_gather_object`` on ``group`` (none when ``group`` is None).
    """
    if group is None:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def barrier(*, group: dist.ProcessGroup | None) -> None:
    """Wait until every rank of ``group`` got here.

    Collectives: one barrier on ``group`` (none when ``group`` is None).
    """
    if group is not None:
        dist.barrier(group=group)


def any_rank(flag: bool, *, group: dist.ProcessGroup | None) -> bool:
    """True on every rank of ``group`` when ``flag`` is True on at least one of them.

    Collectives: one MAX all-reduce of a 1-element tensor on ``group`` (none when ``group`` is None).
    """
    return bool(all_reduce_(torch.tensor([1.0 if flag else 0.0]), op="max", group=group).item())


def global_normalizer(local_normalizer: torch.Tensor, *, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The step's loss normaliser: this rank's fp32 scalar count summed over the data-parallel ``group``.

    ``local_normalizer``: ``ops.compute_normalizer`` of this rank's rows. Returns an fp32 scalar on its device; 0
    when no rank has a response token. Collectives: one SUM all-reduce on ``group``.
    """
    return all_reduce_sum(local_normalizer.float(), group=group)


def global_mean(values: torch.Tensor, *, group: dist.ProcessGroup | None, mask: torch.Tensor | None = None):
    """Mean of ``values`` (``[n]``, optionally only where ``mask`` is True) over all ranks of ``group``.

    Used for ``<H>_ini``: ``global_mean(sequence_mean_entropy(H, response_mask), group=dp_group,
    mask=response_mask.any(-1))`` on the first step (docs/algorithm.md section 4, mode ``paper``).

    Returns:
        fp32 scalar; 0 when nothing is selected anywhere.

    Collectives: one SUM all-reduce of a 2-vector (sum, count) on ``group``.
    """
    keep = torch.ones_like(values, dtype=torch.bool) if mask is None else mask.bool()
    stats = torch.stack([values.detach().float()[keep].sum(), keep.sum(dtype=torch.float32)])
    stats = all_reduce_sum(stats, group=group)
    return stats[0] / stats[1].clamp(min=1.0)


def reduce_metric_sums(
    metrics: Mapping[str, torch.Tensor], *, group: dist.ProcessGroup | None
) -> dict[str, torch.Tensor]:
    """Sum a dict of scalar metric tensors (e.g. the losses' sums and counts) over ``group`` in one collective.

    Every rank must pass the same keys (sorted internally so the order cannot differ).

    Returns:
        dict with the same keys, fp32 scalars.

    Collectives: one SUM all-reduce of a ``[len(metrics)]`` vector on ``group``.
    """
    keys = sorted(metrics)
    if not keys:
        return {}
    stacked = torch.stack([metrics[k].detach().float().reshape(()) for k in keys])
    summed = all_reduce_sum(stacked, group=group)
    return {k: summed[i] for i, k in enumerate(keys)}


def start_broadcast(buffer: torch.Tensor, *, root: int, group: BroadcastGroup) -> dist.Work:
    """Start broadcasting ``buffer`` in place from member ``root`` of a weight group; returns the work to wait on.

    The weight group is ``parallel/weight_group.py``'s; ``wait()`` on the returned work before touching ``buffer``
    again.

    The one exception to "inputs are not modified": receivers pass the buffer to fill, which must be contiguous and
    on ``group.device``; on ``root`` it is read only. Broadcasts started on one group complete in the order started.

    Collectives: one broadcast on ``group.pg`` with the group's timeout.
    """
    options = dist.BroadcastOptions()
    options.rootRank = root
    options.rootTensor = 0
    options.timeout = group.timeout
    return group.pg.broadcast([buffer], options)


def broadcast_buffer(buffer: torch.Tensor, *, root: int, group: BroadcastGroup) -> None:
    """:func:`start_broadcast` and wait for it.

    Collectives: one broadcast on ``group.pg`` with the group's timeout.

    Raises:
        RuntimeError: a member died or did not take part within ``group.timeout_s`` (the group is then unusable).
    """
    start_broadcast(buffer, root=root, group=group).wait()
