"""Who sends which piece of which Hugging Face tensor in a ``rollout.weight_sync: sharded`` update (pure Python).

Every rank offers its pieces (one :class:`Offer` per ``(hf_name, part)``: part ``p`` is TP rank ``p``'s rows
(``dim`` 0) or columns (``dim`` 1); a ``WHOLE`` tensor has the one part 0). Each piece goes to its holder with the
fewest bytes so far (ties: lowest global rank), so data-parallel copies share the sending; every rank computes the
same plan. Senders (rank 0 always first) are members ``0 .. S-1`` of the weight group. On engines at TP ``t`` a
tensor split by vLLM has one slice per engine TP rank (``rollout/engine_slices.py``); a worker of rank ``r`` then
receives only the cuts of the parts that overlap its slice (:meth:`ShardPlan.parts_of`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass

WHOLE = -1
"""``dim`` of a tensor sent whole by one owner (``hf_conversion.WHOLE``)."""
EngineSlices = tuple[tuple[int, int, int], ...]
"""Per engine TP rank, the ``(dim, start, stop)`` slice of a tensor that rank loads (``engine_slices.Slice``)."""
Cut = tuple[int, int, tuple[int, int, int] | None]
"""``(tensor index, part index, (dim, offset, length) within the part or None for all of it)``."""


@dataclass(frozen=True, slots=True)
class Offer:
    """A piece a rank holds: part ``part`` of ``num_parts`` of ``name`` along ``dim``; ``order`` sorts the tensors."""

    name: str
    part: int
    num_parts: int
    dim: int
    shape: tuple[int, ...]
    order: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class PlannedTensor:
    """One HF tensor: full ``shape``, ``dim`` its parts are joined along, ``parts[p]`` = (sender, part shape).

    ``slices``: per engine TP rank the slice it loads; None: every worker loads the whole tensor.
    """

    name: str
    dim: int
    shape: tuple[int, ...]
    parts: tuple[tuple[int, tuple[int, ...]], ...]
    slices: EngineSlices | None = None

    def cuts(self, rank: int) -> list[tuple[int, tuple[int, int, int] | None]]:
        """``(part, (dim, offset, length) or None)`` of every part overlapping engine TP rank ``rank``'s slice."""
        if self.slices is None:
            return [(p, None) for p in range(len(self.parts))]
        dim, start, stop = self.slices[rank]
        cuts, low = [], 0
        for p, (_, shape) in enumerate(self.parts):
            high = low + (self.shape[dim] if self.dim == WHOLE else shape[dim])
            if max(low, start) < min(high, stop):
                cuts.append((p, (dim, max(low, start) - low, min(high, stop) - max(low, start))))
            low = high
        return cuts

    def cut_shape(self, p: int, cut: tuple[int, int, int] | None) -> tuple[int, ...]:
        """Shape of part ``p`` after ``cut``."""
        shape = self.shape if self.dim == WHOLE else self.parts[p][1]
        if cut is None:
            return self.parts[p][1]
        return shape[: cut[0]] + (cut[2],) + shape[cut[0] + 1 :]


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """Tensors in send order, senders, buckets and the engines' TP size.

    ``senders[i]``: global rank of member ``i``; ``buckets``: ``[start, stop)`` tensor ranges; worker ``g`` is
    engine TP rank ``g % engine_tp_size``.
    """

    tensors: tuple[PlannedTensor, ...]
    senders: tuple[int, ...]
    buckets: tuple[tuple[int, int], ...]
    engine_tp_size: int = 1

    def parts_of(self, bucket: int, sender: int, rank: int = 0) -> list[Cut]:
        """The cuts ``sender`` sends engine TP rank ``rank``'s workers in ``bucket``, in payload order."""
        start, stop = self.buckets[bucket]
        return [(t, p, cut) for t in range(start, stop) for p, cut in self.tensors[t].cuts(rank)
                if self.tensors[t].parts[p][0] == sender]  # fmt: skip

    def part_numels(self, bucket: int, sender: int, rank: int = 0) -> list[int]:
        """Elements of each of ``parts_of(bucket, sender, rank)``."""
        return [math.prod(self.tensors[t].cut_shape(p, cut)) for t, p, cut in self.parts_of(bucket, sender, rank)]

    def sender_elements(self, num_engines: int = 1) -> list[int]:
        """Elements each sender sends to ``num_engines`` engines (``engine_tp_size`` workers each)."""
        totals = [0] * len(self.senders)
        for tensor in self.tensors:
            for rank in range(self.engine_tp_size):
                for p, cut in tensor.cuts(rank):
                    totals[tensor.parts[p][0]] += math.prod(tensor.cut_shape(p, cut)) * num_engines
        return totals

    def to_json(self) -> str:
        """The plan as JSON (sender 0 sends it to every worker at the start of an update)."""
        return json.dumps({"tensors": [[t.name, t.dim, t.shape, t.parts, t.slices] for t in self.tensors],
                           "senders": self.senders, "buckets": self.buckets,
                           "engine_tp_size": self.engine_tp_size})  # fmt: skip

    @classmethod
    def from_json(cls, text: str) -> ShardPlan:
        """Inverse of :meth:`to_json`."""
        raw = json.loads(text)
        tensors = tuple(
            PlannedTensor(name, dim, tuple(shape), tuple((s, tuple(p)) for s, p in parts), _tuples(slices))
            for name, dim, shape, parts, slices in raw["tensors"]
        )
        return cls(tensors, tuple(raw["senders"]), tuple(tuple(b) for b in raw["buckets"]), raw["engine_tp_size"])


def _tuples(slices: list | None) -> EngineSlices | None:
    return None if slices is None else tuple(tuple(s) for s in slices)


def _full_shape(name: str, dim: int, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The joined shape of ``shapes`` along ``dim``; ``ValueError`` when the other dimensions disagree."""
    if dim == WHOLE:
        return shapes[0]
    rest = {s[:dim] + s[dim + 1 :] for s in shapes}
    if len(rest) != 1:
        raise ValueError(f"the parts of {name!r} have shapes {shapes}, which do not join along dim {dim}")
    return shapes[0][:dim] + (sum(s[dim] for s in shapes),) + shapes[0][dim + 1 :]


def _owners(offers: list[list[Offer]]) -> dict[tuple[str, int], tuple[Offer, int]]:
    """Each piece's ``(offer, owner rank)``: the holder with the fewest bytes so far, ties to the lowest rank."""
    holders: dict[tuple[str, int], list[int]] = {}
    first: dict[tuple[str, int], Offer] = {}
    for rank, rank_offers in enumerate(offers):
        for offer in rank_offers:
            holders.setdefault((offer.name, offer.part), []).append(rank)
            first.setdefault((offer.name, offer.part), offer)
    for name, num_parts in {offer.name: offer.num_parts for offer in first.values()}.items():
        missing = [p for p in range(num_parts) if (name, p) not in first]
        if missing:
            raise ValueError(f"no training rank holds parts {missing} of {name!r}: that slice would stay unsent")
    load = [0] * len(offers)
    owners = {}
    for key in sorted(first, key=lambda k: (first[k].order, k)):
        offer = first[key]
        if math.prod(offer.shape) == 0:  # a TP rank holding only padding sends nothing
            continue
        owner = min(holders[key], key=lambda r: (load[r], r))
        load[owner] += math.prod(offer.shape)
        owners[key] = (offer, owner)
    return owners


def build_shard_plan(
    offers: list[list[Offer]],
    *,
    bucket_bytes: int,
    element_size: int,
    engine_tp_size: int = 1,
    slicer: Callable[[str, tuple[int, ...]], EngineSlices | None] | None = None,
) -> ShardPlan:
    """The plan for the offers of every global rank (``offers[rank]``); sizes in the engines' dtype.

    ``slicer(name, full shape)``: the tensor's per-engine-rank slices (``engine_slices.tensor_slices``); None:
    every worker receives every tensor whole (engines at TP 1).

    Raises:
        ValueError: ``bucket_bytes < 2``; a tensor with a part nobody offers (a slice would stay unsent), whose
            parts do not join, or that the engines slice along another dimension than its parts.
    """
    if bucket_bytes < 2:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 2 (two half buckets in flight)")
    owners = _owners(offers)
    by_name: dict[str, list[tuple[Offer, int]]] = {}
    for (name, _), owned in sorted(owners.items(), key=lambda item: item[0]):
        by_name.setdefault(name, []).append(owned)
    senders = sorted({0} | {owner for _, owner in owners.values()})
    index = {rank: i for i, rank in enumerate(senders)}
    tensors = []
    for name, owned in sorted(by_name.items(), key=lambda item: (item[1][0][0].order, item[0])):
        dim, shapes = owned[0][0].dim, [offer.shape for offer, _ in owned]
        planned = tuple((index[owner], offer.shape) for offer, owner in owned)
        shape = _full_shape(name, dim, shapes)
        slices = None if slicer is None or engine_tp_size == 1 else slicer(name, shape)
        if slices is not None and dim not in (WHOLE, slices[0][0]):
            raise ValueError(f"{name!r}: the trainer splits it along dim {dim}, the engines along {slices[0][0]}")
        tensors.append(PlannedTensor(name, dim, shape, planned, slices))
    buckets = _buckets(tensors, bucket_bytes // 2, element_size)
    return ShardPlan(tuple(tensors), tuple(senders), buckets, engine_tp_size)


def _buckets(tensors: list[PlannedTensor], capacity: int, element_size: int) -> tuple[tuple[int, int], ...]:
    """Consecutive ``[start, stop)`` ranges of at most ``capacity`` bytes (a larger tensor alone)."""
    buckets, start, used = [], 0, 0
    for i, tensor in enumerate(tensors):
        nbytes = math.prod(tensor.shape) * element_size
        if i > start and used + nbytes > capacity:
            buckets.append((start, i))
            start, used = i, 0
        used += nbytes
    if start < len(tensors):
        buckets.append((start, len(tensors)))
    return tuple(buckets)
