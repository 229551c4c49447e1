"""The sharded weight sync's messages (members ``0 .. S-1``: the plan's senders; ``S + g``: engine worker ``g``).

Per update sender 0 sends each worker the plan (int64 length, then JSON; tag 0); per bucket ``b`` (tag ``b + 1``)
every sender with parts in it sends each worker one uint8 message: an int64 status (1; -1 aborts, the error text
follows) and its cuts for that worker's engine TP rank (``ShardPlan.parts_of``) cast to the engines' dtype, back to
back (one message per engine TP rank, the same for every engine). All senders send at once; a worker posts bucket
``b + 1``'s receives before it joins bucket ``b``'s cuts (``torch.cat`` along the plan's ``dim``) and hands vLLM a
full-shape tensor holding its slice (``engine_slices.place_in_full``). Memory peaks are
in docs/scaling.md ("Weight sync"). A failure names the sender, its trainer rank and the bucket's tensors.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping

import torch

from gtpo_megatron.parallel.collectives import start_recv, start_send, wait_work
from gtpo_megatron.parallel.weight_group import WeightGroup
from gtpo_megatron.rollout.engine import NamedTensor
from gtpo_megatron.rollout.engine_slices import Slice, place_in_full
from gtpo_megatron.rollout.shard_plan import ShardPlan
from gtpo_megatron.rollout.weight_wire import WireStats

_STATUS = 8  # bytes of the int64 status in front of each bucket message
PieceKey = tuple[str, int]


def _names(plan: ShardPlan, parts: list) -> str:
    names = [plan.tensors[t].name for t, *_ in parts]
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _pack(plan: ShardPlan, bucket: int, sender: int, rank: int, pieces: Mapping[PieceKey, torch.Tensor], dtype,
          device):  # fmt: skip
    """``sender``'s cuts of ``bucket`` for engine TP rank ``rank``, cast to ``dtype``, behind a status of 1."""
    parts, numels = plan.parts_of(bucket, sender, rank), plan.part_numels(bucket, sender, rank)
    element = torch.empty((), dtype=dtype).element_size()
    message = torch.empty(_STATUS + sum(numels) * element, dtype=torch.uint8, device=device)
    message[:_STATUS].view(torch.int64).fill_(1)
    values, offset = message[_STATUS:].view(dtype), 0
    for (t, p, cut), numel in zip(parts, numels):
        piece = pieces[(plan.tensors[t].name, p)].detach()
        piece = piece if cut is None else piece.narrow(*cut)
        values[offset : offset + numel].view(piece.shape).copy_(piece)
        offset += numel
    return message


def _abort_message(size: int, error: BaseException) -> torch.Tensor:
    """A message of ``size`` bytes (what the workers expect) with status -1 and as much of the error as fits."""
    message = torch.zeros(size, dtype=torch.uint8)
    message[:_STATUS].view(torch.int64).fill_(-1)
    text = repr(error).encode()[: size - _STATUS]
    message[_STATUS : _STATUS + len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    return message


def _send_plan(plan: ShardPlan, dtype: torch.dtype, workers: range, group: WeightGroup) -> None:
    text = json.dumps({"dtype": str(dtype).removeprefix("torch."), "plan": plan.to_json()}).encode()
    body = torch.frombuffer(bytearray(text), dtype=torch.uint8).to(group.device)
    size = torch.tensor([len(text)], dtype=torch.int64, device=group.device)
    for worker in workers:
        try:
            for message in (size, body):
                wait_work(start_send(message, dst=worker, tag=0, group=group), group=group)
        except RuntimeError as err:
            raise RuntimeError(
                f"weight update (sharded): sender 0 (trainer rank {plan.senders[0]}) could not deliver the plan to "
                f"engine worker {worker - len(plan.senders)} within {group.timeout_s:g} s: {err}"
            ) from err


def _rank(plan: ShardPlan, member: int) -> int:
    """The engine TP rank of the worker that is weight-group member ``member``."""
    return (member - len(plan.senders)) % plan.engine_tp_size


def _wait_all(sends: list, plan: ShardPlan, bucket: int, group: WeightGroup, stats: WireStats) -> None:
    """Wait for one bucket's sends; ``RuntimeError`` naming the worker, this sender and the tensors."""
    start = time.perf_counter()
    for worker, work in sends:
        if worker is None:  # the message itself
            continue
        try:
            wait_work(work, group=group)
        except RuntimeError as err:
            raise RuntimeError(
                f"weight update (sharded): sender {group.rank} (trainer rank {plan.senders[group.rank]}) could not "
                f"deliver bucket {bucket} ({_names(plan, plan.parts_of(bucket, group.rank, _rank(plan, worker)))}) "
                f"to engine worker "
                f"{worker - len(plan.senders)} within {group.timeout_s:g} s: {err}"
            ) from err
    stats.transfer_s += time.perf_counter() - start


def send_shards(
    plan: ShardPlan,
    pieces: Mapping[PieceKey, torch.Tensor],
    *,
    group: WeightGroup,
    num_workers: int,
    dtype: torch.dtype,
) -> WireStats:
    """Send this sender's (member ``group.rank``) parts of every bucket to every worker; returns its ``WireStats``.

    ``pieces``: ``(hf_name, part) -> tensor`` (at least the parts the plan gives this sender). Every worker runs
    :func:`receive_shards`. Collectives: point-to-point sends on ``group``, one bucket in flight.

    Raises:
        RuntimeError: a worker died or timed out (``group.timeout_s``), naming it and the bucket's tensors.
        BaseException: whatever packing raised, after the workers were sent an abort for that bucket.
    """
    sender, stats = group.rank, WireStats()
    workers = range(len(plan.senders), len(plan.senders) + num_workers)
    if sender == 0:
        _send_plan(plan, dtype, workers, group)
    in_flight, last = [], 0  # the bucket in flight: (worker, work) and its message, kept alive until sent
    for bucket in range(len(plan.buckets)):
        parts = {r: plan.parts_of(bucket, sender, r) for r in range(plan.engine_tp_size)}
        parts = {r: cuts for r, cuts in parts.items() if cuts}  # engine TP rank -> its cuts
        if not parts:
            continue
        try:
            messages = {r: _pack(plan, bucket, sender, r, pieces, dtype, group.device) for r in parts}
        except BaseException as err:
            element = torch.empty((), dtype=dtype).element_size()
            aborts = {r: _abort_message(_STATUS + sum(plan.part_numels(bucket, sender, r)) * element, err)
                      for r in parts}  # fmt: skip
            _wait_all(_start(aborts, plan, bucket, workers, group), plan, bucket, group, stats)
            raise
        _wait_all(in_flight, plan, last, group, stats)  # the previous bucket: one in flight while packing
        in_flight, last = _start(messages, plan, bucket, workers, group), bucket
        in_flight += [(None, message) for message in messages.values()]
        stats.add_bucket(sum(map(len, parts.values())), sum(m.numel() - _STATUS for m in messages.values()))
    _wait_all(in_flight, plan, last, group, stats)
    return stats


def _start(messages: dict, plan: ShardPlan, bucket: int, workers: range, group: WeightGroup) -> list:
    """Start sending each worker its engine TP rank's message of ``bucket``: ``(worker, work)``."""
    return [(w, start_send(messages[_rank(plan, w)].to(group.device), dst=w, tag=bucket + 1, group=group))
            for w in workers if _rank(plan, w) in messages]  # fmt: skip


def _receive_plan(group: WeightGroup) -> tuple[ShardPlan, torch.dtype]:
    size = torch.zeros(1, dtype=torch.int64, device=group.device)
    wait_work(start_recv(size, src=0, tag=0, group=group), group=group)
    body = torch.empty(int(size.item()), dtype=torch.uint8, device=group.device)
    wait_work(start_recv(body, src=0, tag=0, group=group), group=group)
    raw = json.loads(body.cpu().numpy().tobytes())
    return ShardPlan.from_json(raw["plan"]), getattr(torch, raw["dtype"])


def _post(plan: ShardPlan, bucket: int, element: int, group: WeightGroup) -> list:
    """Start receiving every sender's cuts of ``bucket`` for this worker: ``(sender, message, work)``."""
    posted, rank = [], _rank(plan, group.rank)
    for sender in range(len(plan.senders)):
        numel = sum(plan.part_numels(bucket, sender, rank))
        if plan.parts_of(bucket, sender, rank):
            message = torch.empty(_STATUS + numel * element, dtype=torch.uint8, device=group.device)
            posted.append((sender, message, start_recv(message, src=sender, tag=bucket + 1, group=group)))
    return posted


def _join(plan: ShardPlan, bucket: int, posted: list, dtype, group: WeightGroup) -> dict[tuple[int, int], torch.Tensor]:
    """Wait for ``bucket``'s messages; ``(tensor, part) -> flat view``. ``RuntimeError`` naming a failed sender."""
    flat, rank = {}, _rank(plan, group.rank)
    for sender, message, work in posted:
        parts = plan.parts_of(bucket, sender, rank)
        who = f"sender {sender} (trainer rank {plan.senders[sender]}; bucket {bucket}: {_names(plan, parts)})"
        try:
            wait_work(work, group=group)
        except RuntimeError as err:
            raise RuntimeError(
                f"weight update (sharded): nothing from {who} within {group.timeout_s:g} s: {err}"
            ) from err
        if int(message[:_STATUS].view(torch.int64).item()) != 1:
            text = message[_STATUS:].cpu().numpy().tobytes().rstrip(b"\0").decode(errors="replace")
            raise RuntimeError(f"weight update (sharded): {who} aborted the update half-way: {text}")
        cuts = [(t, p) for t, p, _ in parts]
        flat.update(zip(cuts, message[_STATUS:].view(dtype).split(plan.part_numels(bucket, sender, rank))))
    return flat


def _tensors(plan: ShardPlan, bucket: int, flat: dict, rank: int, dtype) -> Iterator[NamedTensor]:
    """The tensors of ``bucket``: each tensor's cuts joined along its ``dim`` (a lone part: a view).

    A sliced tensor comes as its full shape holding engine TP rank ``rank``'s slice (``engine_slices.place_in_full``).
    """
    start, stop = plan.buckets[bucket]
    for t in range(start, stop):
        tensor = plan.tensors[t]
        parts = [flat[(t, p)].view(tensor.cut_shape(p, cut)) for p, cut in tensor.cuts(rank)]
        if tensor.slices is None:
            yield tensor.name, parts[0] if len(parts) == 1 else torch.cat(parts, dim=tensor.dim)
            continue
        where = Slice(*tensor.slices[rank])
        empty = tensor.shape[: where.dim] + (0,) + tensor.shape[where.dim + 1 :]
        joined = torch.cat(parts, dim=where.dim) if parts else torch.empty(empty, dtype=dtype)
        yield tensor.name, place_in_full(joined, tensor.shape, where)


def receive_shards(group: WeightGroup, stats: WireStats | None = None) -> Iterator[NamedTensor]:
    """Yield the full ``(hf_name, tensor)`` pairs of one update as their buckets arrive (an engine worker).

    Tensors are in the senders' dtype; views of their bucket or fresh joins. Close the generator when the load
    fails: the rest of the update is then received and dropped, so the senders finish. Collectives: the
    receives matching :func:`send_shards`.

    Raises:
        RuntimeError: a sender aborted, died or timed out (``group.timeout_s``), naming it and its tensors.
    """
    stats = stats if stats is not None else WireStats()
    plan, dtype = _receive_plan(group)
    element = torch.empty((), dtype=dtype).element_size()
    posted = _post(plan, 0, element, group) if plan.buckets else []
    bucket = 0
    try:
        for bucket in range(len(plan.buckets)):
            start = time.perf_counter()
            flat = _join(plan, bucket, posted, dtype, group)
            stats.transfer_s += time.perf_counter() - start
            posted = _post(plan, bucket + 1, element, group) if bucket + 1 < len(plan.buckets) else []
            yield from _tensors(plan, bucket, flat, _rank(plan, group.rank), dtype)
            stats.add_bucket(
                plan.buckets[bucket][1] - plan.buckets[bucket][0], sum(v.numel() for v in flat.values()) * element
            )
    except GeneratorExit:  # vLLM's load raised: take the rest so that no sender waits for its timeout
        for rest in range(bucket + 1, len(plan.buckets)):
            _join(plan, rest, posted, dtype, group)
            posted = _post(plan, rest + 1, element, group) if rest + 1 < len(plan.buckets) else []
        raise
