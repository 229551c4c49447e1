"""Stream full Hugging Face tensors ``(hf_name, tensor)`` out of a TP/PP-sharded Megatron ``GPTModel``.

Peak extra memory is one full parameter (plus its TP shards while they are gathered): tensors are produced and
yielded one at a time, never collected. Layout rules (fused QKV split per query group, fused gate/up split, padded
vocabulary rows trimmed, the tied output layer skipped) live in ``megatron_adapter.hf_conversion``. A head-padded
model (``megatron_adapter.head_padding``) streams without its all-zero padded groups: the names and shapes are
exactly the original HF model's (the padded groups are gathered over TP, then dropped).

Who sees what: every rank of the model-parallel group (all TP x PP ranks of one data-parallel replica) yields the
*same* complete sequence of names, in pipeline-stage order then parameter order. Each DP replica runs its own
gather inside its own groups (no DP traffic); consumers that need a single writer (export, a vLLM push) let one
rank act, e.g. global rank 0.

Collectives, per stage ``s`` of the pipeline (skipped when the size is 1):
* ``broadcast_object_list`` on the PP group from stage ``s``: the stage's parameter list (name, shard shape,
  dtype) so the other stages know what to receive;
* per parameter: one ``all_gather`` on the TP group (not for replicated norms) on stage ``s``, then one
  ``broadcast`` on the PP group per HF tensor from stage ``s``.
All ranks of the model-parallel group must drain the generator to the end (the collectives are matched).
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
    """Yield ``(hf_name, full_tensor)`` for every HF weight of the model, on every model-parallel rank.

    Args:
        model: this rank's *unwrapped* ``GPTModel`` stage (not the DDP wrapper).
        geometry: ``ModelGeometry`` the model was built with (``geometry.tp_size == groups.tp_size``).
        groups: ``ParallelGroups``; uses ``groups.tp`` and ``groups.pp`` (see module docstring).

    Yields:
        HF parameter name and a fresh full tensor in the parameter dtype, on the parameter device (CPU on a CPU
        run). The caller may keep or free it; the generator holds no reference once the next item is requested.
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
