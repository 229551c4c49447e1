"""Which slice of each Hugging Face tensor a worker of an engine at TP ``t`` loads (vLLM's tensor-parallel layout).

The one owner of that rule on our side; the slices are listed in docs/scaling.md, "Engine slices".

A worker hands vLLM's unchanged loaders a full-shape tensor with only its slice written
(:func:`place_in_full`): they read exactly that slice (docs/scaling.md, "Weight sync").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

VOCAB_PADDING = 64
"""vLLM's ``DEFAULT_VOCAB_PADDING_SIZE``: the vocabulary is padded to a multiple of this before it is split."""
_COLUMN_BY_HEADS = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv"}
_COLUMN = ("gate_proj", "up_proj")
_ROW = ("o_proj", "down_proj")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True, slots=True)
class EngineGeometry:
    """What the slicing needs: the engines' ``tp_size`` (``rollout.engine_tp_size``) and the HF Q, G, D, V."""

    tp_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    @classmethod
    def from_hf(cls, hf_config, *, tp_size: int) -> EngineGeometry:
        """The geometry of ``hf_config`` (a transformers config) on engines at ``tp_size``."""
        heads = hf_config.num_attention_heads
        return cls(
            tp_size=tp_size,
            num_heads=heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
            vocab_size=hf_config.vocab_size,
        )


@dataclass(frozen=True, slots=True)
class Slice:
    """Rows (``dim`` 0) or columns (``dim`` 1) ``[start, stop)`` of a full HF tensor."""

    dim: int
    start: int
    stop: int


def _rows(start: int, size: int) -> Slice:
    return Slice(0, start, start + size)


def engine_slice(name: str, shape: tuple[int, ...], geometry: EngineGeometry, rank: int) -> Slice | None:
    """Engine TP rank ``rank``'s slice of the HF tensor ``name`` of ``shape``; None: it loads the whole tensor.

    Raises:
        ValueError: a dimension that the engine's TP size does not divide (vLLM would refuse the model too).
    """
    t, parts = geometry.tp_size, name.split(".")
    if t == 1 or len(parts) < 2:
        return None
    module, leaf = parts[-2], parts[-1]
    if name in _VOCAB:
        per = _divide(math.ceil(geometry.vocab_size / VOCAB_PADDING) * VOCAB_PADDING, t, name)
        start = min(rank * per, geometry.vocab_size)
        return Slice(0, start, min(start + per, geometry.vocab_size))
    if module in _COLUMN_BY_HEADS:
        if module == "q_proj":
            return _rows(rank * _divide(geometry.num_heads, t, name) * geometry.head_dim,
                         _divide(geometry.num_heads, t, name) * geometry.head_dim)  # fmt: skip
        groups = geometry.num_kv_heads
        local = 1 if t >= groups else _divide(groups, t, name)
        block = rank // _divide(t, groups, name) if t >= groups else rank
        return _rows(block * local * geometry.head_dim, local * geometry.head_dim)
    if module in _COLUMN:
        size = _divide(shape[0], t, name)
        return _rows(rank * size, size)
    if module in _ROW and leaf == "weight":
        size = _divide(shape[1], t, name)
        return Slice(1, rank * size, (rank + 1) * size)
    return None


def tensor_slices(
    name: str, shape: tuple[int, ...], geometry: EngineGeometry
) -> tuple[tuple[int, int, int], ...] | None:
    """Every engine TP rank's :func:`engine_slice` as ``(dim, start, stop)``, in rank order; None: all load it whole."""
    slices = [engine_slice(name, shape, geometry, rank) for rank in range(geometry.tp_size)]
    return None if slices[0] is None else tuple((s.dim, s.start, s.stop) for s in slices)


def place_in_full(piece: torch.Tensor, shape: tuple[int, ...], where: Slice) -> torch.Tensor:
    """A tensor of the full ``shape`` whose ``where`` slice is ``piece`` (the rest uninitialised: never read).

    vLLM's loaders narrow the full tensor to the worker's slice, so they read exactly ``piece``. ``torch.empty``
    of a large tensor maps pages lazily: only the slice's pages are touched.
    """
    full = torch.empty(shape, dtype=piece.dtype, device=piece.device)
    full.narrow(where.dim, where.start, where.stop - where.start).copy_(piece)
    return full


def _divide(value: int, by: int, name: str) -> int:
    if value % by:
        raise ValueError(f"{name}: {value} does not split into {by} equal parts (rollout.engine_tp_size={by})")
    return value // by
