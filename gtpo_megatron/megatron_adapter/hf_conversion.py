"""Hugging Face <-> Megatron-Core weight layout for Llama / Mistral / Qwen2 / Qwen3 decoders (pure tensor code).

Names are global (``decoder.layers.{i}``, see ``global_param_name``). Shapes on TP rank ``r`` (Q heads, G KV
groups, ``G_pad`` with head padding, D head_dim, F the MLP width):

* embedding / ``output_layer.weight``: ``[V/tp, H]``, padded rows zero; with tied embeddings the last stage's
  output layer loads from ``model.embed_tokens.weight`` and is not exported.
* ``linear_qkv``: ``[(G_pad/tp) * (Q/G + 2) * D, H]``, per KV group its query heads, key, value; padded groups zero.
* ``linear_proj.weight``: ``[H, Q_pad * D / tp]``; ``linear_fc1``: ``[2 * F/tp, H]`` (gate rows, then up rows);
  ``linear_fc2.weight``: ``[H, F/tp]``. Their biases are ``[H]``, replicated. Norms are replicated (TE's fused
  ``layer_norm_weight`` spellings are accepted).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from gtpo_megatron.megatron_adapter.head_padding import padded_num_query_groups

VOCAB, QKV, PROJ, FC1, ROW, REPLICATED = "vocab", "qkv", "proj", "fc1", "row", "replicated"

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
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
    """Shapes the conversion needs (HF Q, G, D), plus ``num_pad_groups`` zero KV groups (``head_padding``)."""

    num_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    padded_vocab_size: int
    tie_word_embeddings: bool
    tp_size: int
    num_pad_groups: int = 0

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
        )


@dataclass(frozen=True)
class ParamMapping:
    """How one Megatron parameter relates to HF tensors: its shard ``kind`` and the HF names it fuses."""

    kind: str
    hf_names: tuple[str, ...]
    exported: bool = True


def global_param_name(local_name: str, layer_offset: int) -> str:
    """``decoder.layers.{j}.x`` of a pipeline stage whose first layer is ``layer_offset`` -> global index."""
    match = _LAYER_RE.match(local_name)
    if match is None:
        return local_name
    return f"decoder.layers.{int(match.group(1)) + layer_offset}.{match.group(2)}"


def param_mapping(name: str, geometry: ModelGeometry) -> ParamMapping:
    """Mapping of the global Megatron parameter ``name``; ValueError for one it does not know (MoE, MLA)."""
    if name == "embedding.word_embeddings.weight":
        return ParamMapping(VOCAB, ("model.embed_tokens.weight",))
    if name == "output_layer.weight":
        if geometry.tie_word_embeddings:
            return ParamMapping(VOCAB, ("model.embed_tokens.weight",), exported=False)
        return ParamMapping(VOCAB, ("lm_head.weight",))
    if name == "decoder.final_layernorm.weight":
        return ParamMapping(REPLICATED, ("model.norm.weight",))
    match = _LAYER_RE.match(name)
    if match is None or match.group(2) not in _LAYER_MAP:
        raise ValueError(f"Megatron parameter {name!r} has no Hugging Face mapping (unsupported architecture?)")
    kind, suffixes = _LAYER_MAP[match.group(2)]
    return ParamMapping(kind, tuple(f"model.layers.{match.group(1)}.{s}" for s in suffixes))


class HFCheckpointReader:
    """Read only the requested rows/columns of tensors from an HF safetensors folder (sharded or not)."""

    def __init__(self, folder: str | Path):
        from safetensors import safe_open

        folder = Path(folder)
        index = folder / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
        else:
            single = folder / "model.safetensors"
            if not single.exists():
                raise ValueError(
                    f"hf_path={str(folder)!r} has no model.safetensors(.index.json); "
                    "save the model with safe_serialization=True"
                )
            with safe_open(single, "pt") as handle:
                weight_map = {key: single.name for key in handle.keys()}
        handles = {file: safe_open(folder / file, "pt") for file in set(weight_map.values())}
        self._files = {name: handles[file] for name, file in weight_map.items()}

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def shape(self, name: str) -> list[int]:
        """Shape of tensor ``name`` without reading it."""
        return list(self._files[name].get_slice(name).get_shape())

    def read(self, name: str, dim: int = 0, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """``tensor[start:stop]`` along ``dim`` (0 or 1); the whole tensor when ``start`` is None."""
        tensor_slice = self._files[name].get_slice(name)
        if start is None:
            return tensor_slice[:]
        return tensor_slice[start:stop] if dim == 0 else tensor_slice[:, start:stop]


def _zero_padded(tensor: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``tensor`` extended with zeros along ``dim`` (0 or 1) to ``size`` (itself when already that size)."""
    missing = size - tensor.shape[dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor, tensor.new_zeros(shape)], dim=dim)


def _padded_slice(reader: HFCheckpointReader, name: str, dim: int, start: int, size: int) -> torch.Tensor:
    """``tensor[start:start+size]`` along ``dim``, where indices past the HF tensor's end read as zeros."""
    real_size = reader.shape(name)[dim]
    real = reader.read(name, dim, min(start, real_size), min(start + size, real_size))
    return _zero_padded(real, dim, size)


def _qkv_shard(
    reader: HFCheckpointReader, names: tuple[str, ...], geometry: ModelGeometry, tp_rank: int
) -> torch.Tensor:
    """This rank's ``G_pad/tp`` groups: the HF groups among them fused, then zero rows for padded groups."""
    groups = geometry.padded_num_query_groups // geometry.tp_size
    per_group, d = geometry.heads_per_group, geometry.head_dim
    g0 = min(tp_rank * groups, geometry.num_query_groups)
    real = min(groups, geometry.num_query_groups - g0)
    q = reader.read(names[0], 0, g0 * per_group * d, (g0 + real) * per_group * d)
    k = reader.read(names[1], 0, g0 * d, (g0 + real) * d)
    v = reader.read(names[2], 0, g0 * d, (g0 + real) * d)
    tail = q.shape[1:]
    fused = torch.cat(
        [q.reshape(real, per_group * d, *tail), k.reshape(real, d, *tail), v.reshape(real, d, *tail)], dim=1
    )
    return _zero_padded(fused.reshape(real * (per_group + 2) * d, *tail), 0, groups * (per_group + 2) * d)


def shard_from_hf(
    mapping: ParamMapping, reader: HFCheckpointReader, geometry: ModelGeometry, tp_rank: int
) -> torch.Tensor:
    """This TP rank's Megatron shard of one parameter, read from the HF checkpoint (HF dtype, CPU)."""
    tp = geometry.tp_size
    if mapping.kind == VOCAB:
        rows = geometry.padded_vocab_size // tp
        return _padded_slice(reader, mapping.hf_names[0], 0, tp_rank * rows, rows)
    if mapping.kind == PROJ:
        cols = geometry.padded_num_heads * geometry.head_dim // tp
        return _padded_slice(reader, mapping.hf_names[0], 1, tp_rank * cols, cols)
    if mapping.kind == QKV:
        return _qkv_shard(reader, mapping.hf_names, geometry, tp_rank)
    if mapping.kind == REPLICATED:
        return reader.read(mapping.hf_names[0])
    full_shape = reader.shape(mapping.hf_names[0])
    if mapping.kind == FC1:
        rows = full_shape[0] // tp
        return torch.cat([reader.read(n, 0, tp_rank * rows, (tp_rank + 1) * rows) for n in mapping.hf_names])
    cols = full_shape[1] // tp
    return reader.read(mapping.hf_names[0], 1, tp_rank * cols, (tp_rank + 1) * cols)


def hf_from_shards(
    mapping: ParamMapping, shards: list[torch.Tensor], geometry: ModelGeometry
) -> list[tuple[str, torch.Tensor]]:
    """Inverse of ``shard_from_hf``: TP shards (rank order) -> full HF tensors, padding dropped, fusions split."""
    if mapping.kind == REPLICATED:
        return [(mapping.hf_names[0], shards[0].clone())]
    if mapping.kind == VOCAB:
        return [(mapping.hf_names[0], torch.cat(shards)[: geometry.vocab_size].clone())]
    if mapping.kind == ROW:
        return [(mapping.hf_names[0], torch.cat(shards, dim=1))]
    if mapping.kind == PROJ:
        width = geometry.num_heads * geometry.head_dim
        return [(mapping.hf_names[0], torch.cat(shards, dim=1)[:, :width].contiguous())]
    if mapping.kind == FC1:
        gates, ups = zip(*(shard.chunk(2) for shard in shards))
        return [(mapping.hf_names[0], torch.cat(gates)), (mapping.hf_names[1], torch.cat(ups))]
    per_group, d = geometry.heads_per_group, geometry.head_dim
    fused = torch.cat(shards)
    tail = fused.shape[1:]
    grouped = fused.reshape(geometry.padded_num_query_groups, (per_group + 2) * d, *tail)
    q, k, v = grouped[: geometry.num_query_groups].split([per_group * d, d, d], dim=1)
    return [(name, part.reshape(-1, *tail).contiguous()) for name, part in zip(mapping.hf_names, (q, k, v))]


def stage_layer_offset(model) -> int:
    """Global index of this pipeline stage's first transformer layer (0 when the stage has none)."""
    layers = model.decoder.layers
    return layers[0].layer_number - 1 if len(layers) else 0


@torch.no_grad()
def load_hf_weights(model, hf_path: str | Path, geometry: ModelGeometry, *, tp_rank: int) -> None:
    """Copy this rank's slices of an HF checkpoint into an unwrapped ``GPTModel`` stage, in place, cast to each dtype.

    Raises:
        ValueError: a tensor is missing from the checkpoint or a shard shape disagrees with the parameter.
    """
    reader = HFCheckpointReader(hf_path)
    offset = stage_layer_offset(model)
    for local_name, param in model.named_parameters():
        mapping = param_mapping(global_param_name(local_name, offset), geometry)
        missing = [n for n in mapping.hf_names if n not in reader]
        if missing:
            raise ValueError(f"hf_path={str(hf_path)!r} lacks {missing} needed for Megatron parameter {local_name!r}")
        shard = shard_from_hf(mapping, reader, geometry, tp_rank)
        if tuple(shard.shape) != tuple(param.shape):
            raise ValueError(
                f"shard of {local_name!r} from {mapping.hf_names} has shape {tuple(shard.shape)}, "
                f"the Megatron parameter {tuple(param.shape)}; the HF config and checkpoint disagree"
            )
        param.data.copy_(shard)
