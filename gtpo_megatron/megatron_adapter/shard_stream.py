"""The pieces of Hugging Face tensors this rank's own parameters hold, for ``rollout.weight_sync: sharded``.

No collectives and no copies (but a LoRA run's merged weights): each exported parameter of the unwrapped stage goes
through ``hf_conversion.hf_pieces`` (fusions split, head padding and padded vocabulary rows dropped) at this rank's
TP rank, and the views are offered to ``rollout/shard_plan.py`` as part ``tp_rank`` of ``tp_size`` (a replicated
tensor or an expert: part 0 of 1). Names are global, so PP stages offer their own layers and EP ranks their own
experts; every data-parallel replica offers the same pieces and the plan spreads the sending over them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from gtpo_megatron.megatron_adapter.hf_conversion import (
    EXPERT,
    EXPERT_FC1,
    REPLICATED,
    ModelGeometry,
    global_named_parameters,
    hf_pieces,
    param_mapping,
)
from gtpo_megatron.megatron_adapter.lora import adapters_by_weight, merged_weight
from gtpo_megatron.rollout.shard_plan import Offer

if TYPE_CHECKING:
    from gtpo_megatron.parallel.groups import ParallelGroups

PieceKey = tuple[str, int]
_WHOLE_KINDS = (REPLICATED, EXPERT, EXPERT_FC1)


def shard_pieces(
    named_params, geometry: ModelGeometry, *, tp_rank: int, tp_size: int, stage: int
) -> tuple[list[Offer], dict[PieceKey, torch.Tensor]]:
    """``(offers, (hf_name, part) -> view)`` of ``(global_name, shard)`` pairs on TP rank ``tp_rank``, PP ``stage``.

    Raises:
        ValueError: a parameter without a Hugging Face mapping (``hf_conversion.param_mapping``).
    """
    offers, pieces = [], {}
    for position, (name, shard) in enumerate(named_params):
        mapping = param_mapping(name, geometry)
        if not mapping.exported:
            continue
        part, num_parts = (0, 1) if mapping.kind in _WHOLE_KINDS else (tp_rank, tp_size)
        for i, (hf_name, dim, piece) in enumerate(hf_pieces(mapping, shard.detach(), geometry, tp_rank)):
            offers.append(Offer(hf_name, part, num_parts, dim, tuple(piece.shape), (stage, position, i)))
            pieces[(hf_name, part)] = piece
    return offers, pieces


def local_shard_pieces(
    model, geometry: ModelGeometry, groups: ParallelGroups
) -> tuple[list[Offer], dict[PieceKey, torch.Tensor]]:
    """:func:`shard_pieces` of this rank's unwrapped stage; each adapted weight merged (a copy, ``merged_weight``)."""
    adapters = adapters_by_weight(model)
    named = ((name, merged_weight(shard, adapters.get(name))) for name, shard in global_named_parameters(model))
    return shard_pieces(named, geometry, tp_rank=groups.tp_rank, tp_size=groups.tp_size, stage=groups.pp_rank)
