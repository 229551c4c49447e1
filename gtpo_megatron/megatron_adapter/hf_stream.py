"""Stream full Hugging Face tensors ``(hf_name, tensor)`` out of a TP/PP-sharded Megatron ``GPTModel``.

One full parameter at a time (peak extra memory: one tensor plus its TP shards); layout rules are
``hf_conversion``'s, and a head-padded model streams without its padding. Every rank of the model-parallel group
yields the same sequence (stage order, then parameter order); each DP replica gathers in its own groups. An expert
parameter is gathered over the EP group instead: the ``ep_size`` copies of local expert ``e`` are global experts
``r * E / ep_size + e``, yielded in EP-rank order ``r``. A linear with LoRA adapters streams its merged weight
``W + alpha / rank * B @ A`` (each TP shard merged locally, ``lora.merged_weight``); the adapters are not streamed.

Collectives per pipeline stage ``s`` (skipped at size 1): one ``broadcast_object_list`` on PP of the stage's
parameter list, then per parameter an ``all_gather`` on TP (not for replicated norms and experts) or, for an expert,
on EP, and a ``broadcast`` on PP per HF tensor. Every model-parallel rank must drain the generator, and with
``ep_size > 1`` every rank of each EP group (EP groups span data-parallel replicas).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from gtpo_megatron.megatron_adapter.hf_conversion import (
    EXPERT,
    EXPERT_FC1,
    REPLICATED,
    ModelGeometry,
    ParamMapping,
    expert_index,
    global_named_parameters,
    hf_from_shards,
    param_mapping,
    with_expert_index,
)
from gtpo_megatron.megatron_adapter.lora import adapters_by_weight, merged_weight

if TYPE_CHECKING:
    from gtpo_megatron.parallel.groups import ParallelGroups


_EXPERT_KINDS = (EXPERT, EXPERT_FC1)


def _stage_entries(model, geometry: ModelGeometry) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """``(global_name, local_shard_shape, dtype)`` of every exported parameter of this stage."""
    return [
        (name, tuple(param.shape), param.dtype)
        for name, param in global_named_parameters(model)
        if param_mapping(name, geometry).exported
    ]


def _all_gather(param: torch.Tensor, group, size: int) -> list[torch.Tensor]:
    if size == 1:
        return [param.detach()]
    shards = [torch.empty_like(param) for _ in range(size)]
    dist.all_gather(shards, param.detach().contiguous(), group=group)
    return shards


def _mappings(name: str, geometry: ModelGeometry, groups: ParallelGroups) -> list[tuple[str, ParamMapping]]:
    """``(global_name, mapping)`` of the experts the EP group's copies of ``name`` hold; ``name`` alone otherwise."""
    mapping = param_mapping(name, geometry)
    if mapping.kind not in _EXPERT_KINDS:
        return [(name, mapping)]
    per_rank = geometry.moe.num_experts // groups.ep_size
    local = expert_index(name) - groups.ep_rank * per_rank
    names = [with_expert_index(name, rank * per_rank + local) for rank in range(groups.ep_size)]
    return [(each, param_mapping(each, geometry)) for each in names]


def _gather(param: torch.Tensor, mapping: ParamMapping, groups: ParallelGroups) -> list[torch.Tensor]:
    """This parameter's pieces: its TP shards, its EP group's experts (one each), or itself when replicated."""
    if mapping.kind in _EXPERT_KINDS:
        return _all_gather(param, groups.ep, groups.ep_size)
    if mapping.kind == REPLICATED:
        return [param.detach()]
    return _all_gather(param, groups.tp, groups.tp_size)


def iter_hf_weights(model, geometry: ModelGeometry, groups: ParallelGroups) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, fresh full tensor)`` in the parameter's dtype and device, on every model-parallel rank.

    ``model`` is the unwrapped stage and ``geometry.tp_size`` must equal ``groups.tp_size``; collectives as above.
    """
    by_global = dict(global_named_parameters(model))
    adapters = adapters_by_weight(model)
    device = next(iter(by_global.values())).device
    for stage in range(groups.pp_size):
        entries = _stage_entries(model, geometry) if stage == groups.pp_rank else None
        if groups.pp_size > 1:
            box = [entries]
            dist.broadcast_object_list(box, src=groups.pp_stage_global_rank(stage), group=groups.pp)
            entries = box[0]
        for name, shard_shape, dtype in entries:
            yield from _emit(name, shard_shape, dtype, stage, by_global, adapters, geometry, groups, device)


def _emit(name, shard_shape, dtype, stage, by_global, adapters, geometry, groups: ParallelGroups, device):
    """Produce one Megatron parameter's HF tensors on stage ``stage`` and share them with the other stages."""
    mappings = _mappings(name, geometry, groups)
    if stage == groups.pp_rank:
        pieces = _gather(merged_weight(by_global[name], adapters.get(name)), mappings[0][1], groups)
        if mappings[0][1].kind in _EXPERT_KINDS:  # one expert per EP rank
            tensors = [t for (_, m), piece in zip(mappings, pieces) for t in hf_from_shards(m, [piece], geometry)]
        else:
            tensors = hf_from_shards(mappings[0][1], pieces, geometry)
    else:  # shapes from the same conversion run on meta tensors, then filled by the broadcast
        meta = [torch.empty(shard_shape, dtype=dtype, device="meta")] * geometry.tp_size
        tensors = [
            (n, torch.empty(t.shape, dtype=dtype, device=device))
            for _, mapping in mappings
            for n, t in hf_from_shards(mapping, meta, geometry)
        ]
    for hf_name, tensor in tensors:
        if groups.pp_size > 1:
            tensor = tensor.contiguous()
            dist.broadcast(tensor, src=groups.pp_stage_global_rank(stage), group=groups.pp)
        yield hf_name, tensor
