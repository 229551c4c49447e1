"""Stream full Hugging Face tensors ``(hf_name, tensor)`` out of a TP/PP-sharded Megatron ``GPTModel``.

One full parameter at a time (peak extra memory: one tensor plus its TP shards); layout rules are
``hf_conversion``'s, and a head-padded model streams without its padding. Every rank of the model-parallel group
yields the same sequence (stage order, then parameter order); each DP replica gathers in its own groups.

Collectives per pipeline stage ``s`` (skipped at size 1): one ``broadcast_object_list`` on PP of the stage's
parameter list, then per parameter an ``all_gather`` on TP (not for replicated norms) and a ``broadcast`` on PP
per HF tensor. Every model-parallel rank must drain the generator.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from gtpo_megatron.megatron_adapter.hf_conversion import (
    REPLICATED,
    ModelGeometry,
    ParamMapping,
    global_param_name,
    hf_from_shards,
    param_mapping,
    stage_layer_offset,
)

if TYPE_CHECKING:
    from gtpo_megatron.parallel.groups import ParallelGroups


def _stage_entries(model, geometry: ModelGeometry) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """``(global_name, local_shard_shape, dtype)`` of every exported parameter of this stage."""
    offset = stage_layer_offset(model)
    entries = []
    for local_name, param in model.named_parameters():
        name = global_param_name(local_name, offset)
        if param_mapping(name, geometry).exported:
            entries.append((name, tuple(param.shape), param.dtype))
    return entries


def _gather_tp(param: torch.Tensor, mapping: ParamMapping, tp_group, tp_size: int) -> list[torch.Tensor]:
    if tp_size == 1 or mapping.kind == REPLICATED:
        return [param.detach()]
    shards = [torch.empty_like(param) for _ in range(tp_size)]
    dist.all_gather(shards, param.detach().contiguous(), group=tp_group)
    return shards


def iter_hf_weights(model, geometry: ModelGeometry, groups: ParallelGroups) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, fresh full tensor)`` in the parameter's dtype and device, on every model-parallel rank.

    ``model`` is the unwrapped stage and ``geometry.tp_size`` must equal ``groups.tp_size``; collectives as above.
    """
    local_params = dict(model.named_parameters())
    offset = stage_layer_offset(model)
    by_global = {global_param_name(n, offset): p for n, p in local_params.items()}
    device = next(iter(local_params.values())).device
    for stage in range(groups.pp_size):
        entries = _stage_entries(model, geometry) if stage == groups.pp_rank else None
        if groups.pp_size > 1:
            box = [entries]
            dist.broadcast_object_list(box, src=groups.pp_stage_global_rank(stage), group=groups.pp)
            entries = box[0]
        for name, shard_shape, dtype in entries:
            yield from _emit(name, shard_shape, dtype, stage, by_global, geometry, groups, device)


def _emit(name, shard_shape, dtype, stage, by_global, geometry, groups: ParallelGroups, device):
    """Produce one Megatron parameter's HF tensors on stage ``stage`` and share them with the other stages."""
    mapping = param_mapping(name, geometry)
    if stage == groups.pp_rank:
        tensors = hf_from_shards(mapping, _gather_tp(by_global[name], mapping, groups.tp, groups.tp_size), geometry)
    else:  # shapes from the same conversion run on meta tensors, then filled by the broadcast
        meta = [torch.empty(shard_shape, dtype=dtype, device="meta")] * geometry.tp_size
        tensors = [
            (n, torch.empty(t.shape, dtype=dtype, device=device)) for n, t in hf_from_shards(mapping, meta, geometry)
        ]
    for hf_name, tensor in tensors:
        if groups.pp_size > 1:
            tensor = tensor.contiguous()
            dist.broadcast(tensor, src=groups.pp_stage_global_rank(stage), group=groups.pp)
        yield hf_name, tensor
