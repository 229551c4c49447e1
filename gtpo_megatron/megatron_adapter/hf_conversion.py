"""Hugging Face <-> Megatron-Core weight layout for Llama / Mistral / Qwen2 / Qwen3 decoders and their MoE variants.

Pure tensor code (``hf_loading`` reads a checkpoint into these shards). Names are global (``decoder.layers.{i}``,
experts by global index, see ``global_param_name``).
Shapes on TP rank ``r`` (Q heads, G KV groups, ``G_pad`` with head padding, D head_dim, F the MLP width):

* embedding / ``output_layer.weight``: ``[V/tp, H]``, padded rows zero; with tied embeddings the last stage's
  output layer loads from ``model.embed_tokens.weight`` and is not exported.
* ``linear_qkv``: ``[(G_pad/tp) * (Q/G + 2) * D, H]``, per KV group its query heads, key, value; padded groups zero.
* ``linear_proj.weight``: ``[H, Q_pad * D / tp]``; ``linear_fc1``: ``[2 * F/tp, H]`` (gate rows, then up rows);
  ``linear_fc2.weight``: ``[H, F/tp]``. Their biases are ``[H]``, replicated. Norms are replicated (TE's fused
  ``layer_norm_weight`` spellings are accepted).
* MoE (``moe.features``; the HF names are the family's, ``plan.model_families``): the router ``mlp.router.weight``
  ``[E, H]`` is replicated; expert ``e``'s ``linear_fc1`` ``[2 * F_e, H]`` (gate, up) and ``linear_fc2``
  ``[H, F_e]`` are whole on the EP rank holding it (expert TP 1; ``local_experts.{e}`` of the local spec,
  ``linear_fc1.weight{e}`` of TE's grouped experts); a shared expert is TP-sharded as the dense MLP, its gate
  ``[1, H]`` replicated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from gtpo_megatron.megatron_adapter.head_padding import padded_num_query_groups
from gtpo_megatron.megatron_adapter.moe.features import MoEShape, moe_shape

VOCAB, QKV, PROJ, FC1, ROW, REPLICATED = "vocab", "qkv", "proj", "fc1", "row", "replicated"
EXPERT_FC1, EXPERT = "expert_fc1", "expert"
"""An expert's fused gate/up and its down projection: whole tensors, not TP-sharded, one expert per name."""
LORA = "lora"
"""A linear's adapter tensors (``megatron_adapter/lora.py``): folded into its weight, never exported alone."""

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(
    r"^mlp\.experts\.(?:local_experts\.(?P<local>\d+)\.)?(?P<linear>linear_fc[12])\.weight(?P<grouped>\d*)$"
)
_SHARED_EXPERT = {
    "mlp.shared_experts.linear_fc1.weight": (FC1, (0, 1)),
    "mlp.shared_experts.linear_fc2.weight": (ROW, (2,)),
}
"""A shared expert's fused gate/up and its down projection: the family's linears ``0, 1, 2``."""
_LAYER_MAP = {
    "input_layernorm.weight": (REPLICATED, ("input_layernorm.weight",)),
    "self_attention.linear_qkv.layer_norm_weight": (REPLICATED, ("input_layernorm.weight",)),
    "self_attention.linear_qkv.weight": (
        QKV,
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    ),
    "self_attention.linear_qkv.bias": (
        QKV,
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    ),
    "self_attention.linear_proj.weight": (PROJ, ("self_attn.o_proj.weight",)),
    "self_attention.linear_proj.bias": (REPLICATED, ("self_attn.o_proj.bias",)),
    "self_attention.q_layernorm.weight": (REPLICATED, ("self_attn.q_norm.weight",)),
    "self_attention.k_layernorm.weight": (REPLICATED, ("self_attn.k_norm.weight",)),
    "pre_mlp_layernorm.weight": (REPLICATED, ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.layer_norm_weight": (REPLICATED, ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.weight": (FC1, ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.linear_fc1.bias": (FC1, ("mlp.gate_proj.bias", "mlp.up_proj.bias")),
    "mlp.linear_fc2.weight": (ROW, ("mlp.down_proj.weight",)),
    "mlp.linear_fc2.bias": (REPLICATED, ("mlp.down_proj.bias",)),
}


@dataclass(frozen=True)
class ModelGeometry:
    """Shapes the conversion needs (HF Q, G, D), ``num_pad_groups`` zero KV groups and an MoE model's ``moe``.

    ``num_pad_groups``: see ``head_padding``; ``moe`` is None for a dense model.
    """

    num_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    padded_vocab_size: int
    tie_word_embeddings: bool
    tp_size: int
    num_pad_groups: int = 0
    moe: MoEShape | None = None

    @property
    def heads_per_group(self) -> int:
        """Query heads per KV group, Q/G (the same in the padded model)."""
        return self.num_heads // self.num_query_groups

    @property
    def padded_num_query_groups(self) -> int:
        """G_pad: KV groups of the Megatron model."""
        return self.num_query_groups + self.num_pad_groups

    @property
    def padded_num_heads(self) -> int:
        """Q_pad: attention heads of the Megatron model."""
        return self.padded_num_query_groups * self.heads_per_group

    @classmethod
    def from_hf(
        cls,
        hf_config,
        *,
        padded_vocab_size: int,
        tp_size: int,
        pad_attention_heads: bool = False,
        padding_tp_size: int | None = None,
    ) -> ModelGeometry:
        """Geometry of ``hf_config`` at ``tp_size`` (errors: ``head_padding.padded_num_query_groups``)."""
        heads = hf_config.num_attention_heads
        groups = getattr(hf_config, "num_key_value_heads", None) or heads
        padded_groups = padded_num_query_groups(
            num_heads=heads,
            num_query_groups=groups,
            tp_size=tp_size,
            pad_attention_heads=pad_attention_heads,
            padding_tp_size=padding_tp_size,
        )
        return cls(
            num_heads=heads,
            num_query_groups=groups,
            head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
            vocab_size=hf_config.vocab_size,
            padded_vocab_size=padded_vocab_size,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            tp_size=tp_size,
            num_pad_groups=padded_groups - groups,
            moe=moe_shape(hf_config),
        )


@dataclass(frozen=True)
class ParamMapping:
    """How one Megatron parameter relates to HF tensors: its shard ``kind`` and the HF names it fuses."""

    kind: str
    hf_names: tuple[str, ...]
    exported: bool = True


def global_param_name(local_name: str, layer_offset: int, expert_offset: int = 0) -> str:
    """A stage-local name -> the global one: layer ``j`` -> ``j + layer_offset``, expert ``e`` -> ``e + expert_offset``.

    ``layer_offset`` is the stage's first layer, ``expert_offset`` the EP rank's first expert.
    """
    match = _LAYER_RE.match(local_name)
    if match is None:
        return local_name
    suffix, expert = match.group(2), expert_index(match.group(2))
    if expert >= 0 and expert_offset:
        suffix = with_expert_index(suffix, expert + expert_offset)
    return f"decoder.layers.{int(match.group(1)) + layer_offset}.{suffix}"


def expert_index(name: str) -> int:
    """The expert ``e`` of a global name or layer suffix (``local_experts.{e}``, ``linear_fc*.weight{e}``), else -1."""
    layer = _LAYER_RE.match(name)
    match = _EXPERT_RE.match(layer.group(2) if layer else name)
    if match is None:
        return -1
    return int(match.group("local") or match.group("grouped"))


def with_expert_index(name: str, expert: int) -> str:
    """``name`` (a layer suffix or a global name) naming expert ``expert`` instead."""
    layer = _LAYER_RE.match(name)
    prefix, suffix = (f"decoder.layers.{layer.group(1)}.", layer.group(2)) if layer else ("", name)
    match = _EXPERT_RE.match(suffix)
    if match.group("local") is not None:
        return f"{prefix}mlp.experts.local_experts.{expert}.{match.group('linear')}.weight"
    return f"{prefix}mlp.experts.{match.group('linear')}.weight{expert}"


def stage_offsets(model) -> tuple[int, int]:
    """``(layer_offset, expert_offset)``: global indices of this stage's first layer and this EP rank's first expert.

    ``(0, 0)`` for a stage without layers; the expert offset is 0 for a dense model.
    """
    layers = model.decoder.layers
    if not len(layers):
        return 0, 0
    experts = getattr(layers[0].mlp, "local_expert_indices", None)
    return layers[0].layer_number - 1, int(experts[0]) if experts else 0


def global_named_parameters(model):
    """``(global_name, param)`` of every parameter of this stage (``global_param_name`` of ``stage_offsets``)."""
    layer_offset, expert_offset = stage_offsets(model)
    for local_name, param in model.named_parameters():
        yield global_param_name(local_name, layer_offset, expert_offset), param


def _layer_mapping(layer: str, suffix: str, geometry: ModelGeometry) -> ParamMapping | None:
    """Mapping of the layer parameter ``suffix`` of layer ``layer``; None when no rule knows it."""
    hf_layer = f"model.layers.{layer}"
    if suffix in _LAYER_MAP:
        kind, names = _LAYER_MAP[suffix]
        return ParamMapping(kind, tuple(f"{hf_layer}.{n}" for n in names))
    moe, layer_index = geometry.moe, int(layer)
    if moe is None:
        return None
    family = moe.family
    if suffix == "mlp.router.weight":
        return ParamMapping(REPLICATED, (family.router_name(layer_index),))
    if suffix in _SHARED_EXPERT and moe.shared_expert_ffn_size:
        kind, linears = _SHARED_EXPERT[suffix]
        return ParamMapping(kind, tuple(family.shared_expert_name(layer_index, which) for which in linears))
    if suffix == "mlp.shared_experts.gate_weight" and moe.shared_expert_ffn_size and family.shared_expert_gate:
        return ParamMapping(REPLICATED, (family.shared_gate_name(layer_index),))
    match = _EXPERT_RE.match(suffix)
    if match is None:
        return None
    expert = expert_index(suffix)
    if match.group("linear") == "linear_fc1":
        return ParamMapping(EXPERT_FC1, tuple(family.hf_expert_name(layer_index, expert, i) for i in (0, 1)))
    return ParamMapping(EXPERT, (family.hf_expert_name(layer_index, expert, 2),))


def param_mapping(name: str, geometry: ModelGeometry) -> ParamMapping:
    """Mapping of the global Megatron parameter ``name``; ValueError for one it does not know (e.g. MLA)."""
    if name == "embedding.word_embeddings.weight":
        return ParamMapping(VOCAB, ("model.embed_tokens.weight",))
    if name == "output_layer.weight":
        if geometry.tie_word_embeddings:
            return ParamMapping(VOCAB, ("model.embed_tokens.weight",), exported=False)
        return ParamMapping(VOCAB, ("lm_head.weight",))
    if name == "decoder.final_layernorm.weight":
        return ParamMapping(REPLICATED, ("model.norm.weight",))
    if "_lora." in name:  # lora.SUFFIX
        return ParamMapping(LORA, (), exported=False)
    match = _LAYER_RE.match(name)
    mapping = None if match is None else _layer_mapping(match.group(1), match.group(2), geometry)
    if mapping is None:
        raise ValueError(f"Megatron parameter {name!r} has no Hugging Face mapping (unsupported architecture?)")
    return mapping


WHOLE = -1
"""The ``dim`` of an HF piece that is the whole tensor (a replicated parameter or an expert, from one owner)."""


def hf_pieces(
    mapping: ParamMapping, shard: torch.Tensor, geometry: ModelGeometry, tp_rank: int
) -> list[tuple[str, int, torch.Tensor]]:
    """TP rank ``tp_rank``'s piece of each HF tensor of one parameter: ``(hf_name, dim, view of shard)``.

    The inverse of ``hf_loading.shard_from_hf`` one rank at a time: fusions split, head padding and padded
    vocabulary rows dropped (a rank holding padding only gives an empty piece). The HF tensor is the concatenation
    along ``dim`` (0 rows, 1 columns) of its pieces in TP-rank order, or the one ``WHOLE`` piece. Views, no copies.
    """
    names = mapping.hf_names
    if mapping.kind in (REPLICATED, EXPERT):
        return [(names[0], WHOLE, shard)]
    if mapping.kind == EXPERT_FC1:
        return [(name, WHOLE, half) for name, half in zip(names, shard.chunk(2))]
    if mapping.kind == VOCAB:
        rows = shard.shape[0]
        return [(names[0], 0, shard[: max(0, min(rows, geometry.vocab_size - tp_rank * rows))])]
    if mapping.kind == ROW:
        return [(names[0], 1, shard)]
    if mapping.kind == PROJ:
        cols, width = shard.shape[1], geometry.num_heads * geometry.head_dim
        return [(names[0], 1, shard[:, : max(0, min(cols, width - tp_rank * cols))])]
    if mapping.kind == FC1:
        return [(name, 0, half) for name, half in zip(names, shard.chunk(2))]
    per_group, d = geometry.heads_per_group, geometry.head_dim
    groups = geometry.padded_num_query_groups // geometry.tp_size
    real = max(0, min(groups, geometry.num_query_groups - tp_rank * groups))
    tail = shard.shape[1:]
    q, k, v = shard.reshape(groups, (per_group + 2) * d, *tail)[:real].split([per_group * d, d, d], dim=1)
    return [(name, 0, part.reshape(-1, *tail)) for name, part in zip(names, (q, k, v))]


def hf_from_shards(
    mapping: ParamMapping, shards: list[torch.Tensor], geometry: ModelGeometry
) -> list[tuple[str, torch.Tensor]]:
    """Inverse of ``hf_loading.shard_from_hf``: TP shards (rank order) -> fresh full HF tensors, their ``hf_pieces``."""
    joined: dict[str, list[torch.Tensor]] = {}
    dims: dict[str, int] = {}
    for rank, shard in enumerate(shards):
        for name, dim, piece in hf_pieces(mapping, shard, geometry, rank):
            joined.setdefault(name, []).append(piece)
            dims[name] = dim
    return [
        (name, pieces[0].clone() if dims[name] == WHOLE else torch.cat(pieces, dim=dims[name]))
        for name, pieces in joined.items()
    ]
