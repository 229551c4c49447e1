"""Read a Hugging Face checkpoint into this TP rank's Megatron shards: only the rows/columns the rank holds.

The layout (fused QKV and gate/up, head and vocabulary padding, experts) is ``hf_conversion``'s, which names every
parameter's HF tensors (``param_mapping``) and maps shards back (``hf_pieces``, ``hf_from_shards``). Pure tensor code
on CPU, in the checkpoint's dtype; ``load_hf_weights`` copies into a built stage.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from gtpo_megatron.megatron_adapter.hf_conversion import (
    EXPERT,
    EXPERT_FC1,
    FC1,
    PROJ,
    QKV,
    REPLICATED,
    VOCAB,
    ModelGeometry,
    ParamMapping,
    global_named_parameters,
    param_mapping,
)


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
    if mapping.kind in (REPLICATED, EXPERT):
        return reader.read(mapping.hf_names[0])
    if mapping.kind == EXPERT_FC1:
        return torch.cat([reader.read(name) for name in mapping.hf_names])
    full_shape = reader.shape(mapping.hf_names[0])
    if mapping.kind == FC1:
        rows = full_shape[0] // tp
        return torch.cat([reader.read(n, 0, tp_rank * rows, (tp_rank + 1) * rows) for n in mapping.hf_names])
    cols = full_shape[1] // tp
    return reader.read(mapping.hf_names[0], 1, tp_rank * cols, (tp_rank + 1) * cols)


@torch.no_grad()
def load_hf_weights(model, hf_path: str | Path, geometry: ModelGeometry, *, tp_rank: int) -> None:
    """Copy this rank's slices of an HF checkpoint into an unwrapped ``GPTModel`` stage, in place, cast to each dtype.

    Raises:
        ValueError: a tensor is missing from the checkpoint or a shard shape disagrees with the parameter.
    """
    reader = HFCheckpointReader(hf_path)
    for name, param in global_named_parameters(model):
        mapping = param_mapping(name, geometry)
        missing = [n for n in mapping.hf_names if n not in reader]
        if missing:
            raise ValueError(f"hf_path={str(hf_path)!r} lacks {missing} needed for Megatron parameter {name!r}")
        shard = shard_from_hf(mapping, reader, geometry, tp_rank)
        if tuple(shard.shape) != tuple(param.shape):
            raise ValueError(
                f"shard of {name!r} from {mapping.hf_names} has shape {tuple(shard.shape)}, "
                f"the Megatron parameter {tuple(param.shape)}; the HF config and checkpoint disagree"
            )
        param.data.copy_(shard)
