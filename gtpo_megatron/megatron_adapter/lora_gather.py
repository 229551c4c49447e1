"""The whole model's LoRA adapters as full PEFT tensors, gathered out of their TP shards and pipeline stages.

The TP-split side of an adapter (``lora.py``) is a contiguous block of peft's tensor, so the shards concatenate
back (docs/algorithm.md section 6). Collectives (``parallel/collectives.py``): one ``all_gather`` on TP per split
tensor, in module order, then one ``all_gather_object`` on PP; every model-parallel rank of the replica calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from gtpo_megatron.config.lora import LoRAConfig
from gtpo_megatron.megatron_adapter.lora import adapters_by_weight
from gtpo_megatron.parallel.collectives import all_gather_object, all_gather_tensors
from gtpo_megatron.rollout.peft_adapter import AdapterSpec, tensor_key, write_adapter_folder

if TYPE_CHECKING:
    from gtpo_megatron.parallel.groups import ParallelGroups


def adapter_spec(lora: LoRAConfig, base_model: str = "") -> AdapterSpec:
    """The PEFT config of ``model.lora`` (``alpha`` null: the rank, a scale of 1).

    Raises:
        ValueError: ``lora`` is not enabled (full fine-tuning has no adapters).
    """
    if not lora.enabled:
        raise ValueError("model.lora.rank is null: full fine-tuning has no adapters to write; set model.lora.rank")
    return AdapterSpec(rank=lora.rank, alpha=lora.scale * lora.rank, projections=lora.projections,
                       base_model=base_model)  # fmt: skip


def gather_adapter_tensors(model, groups: ParallelGroups) -> dict[str, torch.Tensor]:
    """``{peft key: full CPU tensor}`` of every adapter of the model, on every model-parallel rank.

    ``model``: the unwrapped stage; tensors in the parameters' dtype. Collectives: module docstring.
    """
    local: dict[str, torch.Tensor] = {}
    for weight_name, adapter in adapters_by_weight(model).items():
        layer = int(weight_name.split(".")[2])  # decoder.layers.<global index>.<parent>.<linear>.weight
        for projection in adapter.lora_A:
            a, b = adapter.lora_A[projection].detach(), adapter.lora_B[projection].detach()
            group = adapter.tp_group if adapter.tp_size > 1 else None
            if adapter.row_parallel:
                a = torch.cat(all_gather_tensors(a, group=group), dim=1)
            else:
                b = torch.cat(all_gather_tensors(b, group=group), dim=0)
            local[tensor_key(layer, projection, "A")] = a.to("cpu", copy=True)
            local[tensor_key(layer, projection, "B")] = b.to("cpu", copy=True)
    if groups.pp_size == 1:
        return local
    return {key: tensor for stage in all_gather_object(local, group=groups.pp) for key, tensor in stage.items()}


def export_adapter(policy, out_dir: str, lora: LoRAConfig, *, base_model: str = "") -> None:
    """Write ``policy``'s adapters as a PEFT folder at ``out_dir``; global rank 0 writes.

    Every model-parallel rank of the replica must call it (the gather's collectives).
    """
    tensors = gather_adapter_tensors(policy.model, policy.groups)
    if policy.groups.rank == 0:
        write_adapter_folder(out_dir, tensors, adapter_spec(lora, base_model))
