"""``rollout/engine_slices.py`` against vLLM's loaders: a worker fed only its slice loads what the full tensor gives.

vLLM's layers are built without a running engine (a stand-in TP group of ``t`` ranks at rank ``r``), in float64.
Each parameter is loaded twice through its own ``weight_loader``: once from the full HF tensor, once from a full-
shape tensor that holds the slice of ``engine_slice`` and NaN everywhere else (a loader reading one value outside
the slice gives a NaN, and ``torch.equal`` fails).
"""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from gtpo_megatron.rollout.engine_slices import EngineGeometry, engine_slice, place_in_full, tensor_slices

HIDDEN, HEADS, HEAD_DIM, FFN, VOCAB = 16, 4, 4, 24, 70  # padded to 128: at TP 4 rank 3 holds padding only
LAYER = "model.layers.0"


def _only_slice(full: torch.Tensor, name: str, geometry: EngineGeometry, rank: int) -> torch.Tensor:
    where = engine_slice(name, tuple(full.shape), geometry, rank)
    if where is None:
        return full
    carrier = torch.full_like(full, float("nan"))
    piece = full.narrow(where.dim, where.start, where.stop - where.start)
    carrier.narrow(where.dim, where.start, where.stop - where.start).copy_(piece)
    return carrier


def _layers(kv_heads: int):
    from vllm.model_executor.layers import linear
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    kw = {"params_dtype": torch.float64}
    return {
        "self_attn.qkv_proj": linear.QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, kv_heads, bias=True, **kw),
        "self_attn.o_proj": linear.RowParallelLinear(HEADS * HEAD_DIM, HIDDEN, bias=False, **kw),
        "mlp.gate_up_proj": linear.MergedColumnParallelLinear(HIDDEN, [FFN, FFN], bias=False, **kw),
        "mlp.down_proj": linear.RowParallelLinear(FFN, HIDDEN, bias=False, **kw),
        "embed_tokens": VocabParallelEmbedding(VOCAB, HIDDEN, **kw),
        "lm_head": ParallelLMHead(VOCAB, HIDDEN, **kw),
    }


def _hf_tensors(kv_heads: int) -> list[tuple[str, str, str, object]]:
    """``(hf_name, vLLM layer, parameter, shard id)`` and a float64 full tensor each."""
    g = torch.Generator().manual_seed(kv_heads)
    q, kv = HEADS * HEAD_DIM, kv_heads * HEAD_DIM
    rows = [("self_attn.q_proj", "self_attn.qkv_proj", "q", q), ("self_attn.k_proj", "self_attn.qkv_proj", "k", kv),
            ("self_attn.v_proj", "self_attn.qkv_proj", "v", kv)]  # fmt: skip
    out = []
    for hf, layer, shard, size in rows:
        out.append((f"{LAYER}.{hf}.weight", layer, "weight", shard, torch.randn(size, HIDDEN, generator=g)))
        out.append((f"{LAYER}.{hf}.bias", layer, "bias", shard, torch.randn(size, generator=g)))
    out += [
        (f"{LAYER}.self_attn.o_proj.weight", "self_attn.o_proj", "weight", None, torch.randn(HIDDEN, q, generator=g)),
        (f"{LAYER}.mlp.gate_proj.weight", "mlp.gate_up_proj", "weight", 0, torch.randn(FFN, HIDDEN, generator=g)),
        (f"{LAYER}.mlp.up_proj.weight", "mlp.gate_up_proj", "weight", 1, torch.randn(FFN, HIDDEN, generator=g)),
        (f"{LAYER}.mlp.down_proj.weight", "mlp.down_proj", "weight", None, torch.randn(HIDDEN, FFN, generator=g)),
        ("model.embed_tokens.weight", "embed_tokens", "weight", None, torch.randn(VOCAB, HIDDEN, generator=g)),
        ("lm_head.weight", "lm_head", "weight", None, torch.randn(VOCAB, HIDDEN, generator=g)),
    ]
    return [(name, layer, param, shard, full.double()) for name, layer, param, shard, full in out]


def _load(layers, layer: str, param: str, shard, tensor: torch.Tensor) -> None:
    target = getattr(layers[layer], param)
    loader = target.weight_loader
    loader(target, tensor) if shard is None else loader(target, tensor, shard)


@pytest.mark.parametrize(("tp_size", "kv_heads"), [(2, 2), (2, 4), (4, 2), (4, 4)])
def test_a_worker_fed_its_slice_loads_what_the_full_tensor_gives(tp_size, kv_heads):
    pytest.importorskip("vllm")
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    geometry = EngineGeometry(tp_size=tp_size, num_heads=HEADS, num_kv_heads=kv_heads, head_dim=HEAD_DIM,
                              vocab_size=VOCAB)  # fmt: skip
    tensors = _hf_tensors(kv_heads)
    for rank in range(tp_size):
        stand_in = SimpleNamespace(rank_in_group=rank, world_size=tp_size)
        with set_current_vllm_config(VllmConfig()), mock.patch.object(parallel_state, "_TP", stand_in):
            full_layers, sliced_layers = _layers(kv_heads), _layers(kv_heads)
        for name, layer, param, shard, full in tensors:
            _load(full_layers, layer, param, shard, full)
            _load(sliced_layers, layer, param, shard, _only_slice(full, name, geometry, rank))
        for layer in full_layers:
            for param, value in full_layers[layer].named_parameters():
                assert torch.equal(value, getattr(sliced_layers[layer], param)), (rank, layer, param)


def test_slices_partition_each_split_tensor_and_keep_the_rest_whole():
    geometry = EngineGeometry(tp_size=4, num_heads=8, num_kv_heads=2, head_dim=4, vocab_size=100)
    q = tensor_slices("model.layers.3.self_attn.q_proj.weight", (32, 16), geometry)
    assert [s[1:] for s in q] == [(0, 8), (8, 16), (16, 24), (24, 32)]
    k = tensor_slices("model.layers.3.self_attn.k_proj.bias", (8,), geometry)  # 2 heads on 4 ranks: replicated
    assert [s[1:] for s in k] == [(0, 4), (0, 4), (4, 8), (4, 8)]
    vocab = tensor_slices("lm_head.weight", (100, 16), geometry)  # padded to 128: 32 rows a rank
    assert [s[1:] for s in vocab] == [(0, 32), (32, 64), (64, 96), (96, 100)]
    down = tensor_slices("model.layers.0.mlp.down_proj.weight", (16, 24), geometry)
    assert {s[0] for s in down} == {1} and down[3][2] == 24
    for whole in (
        "model.norm.weight",
        "model.layers.0.self_attn.o_proj.bias",
        "model.layers.0.mlp.experts.3.w1.weight",
    ):
        assert tensor_slices(whole, (24, 16), geometry) is None
    with pytest.raises(ValueError, match="mlp.up_proj.weight: 24 does not split into 5"):
        engine_slice("model.layers.0.mlp.up_proj.weight", (24, 16), EngineGeometry(5, 5, 5, 4, 100), 0)


def test_place_in_full_writes_the_slice_where_the_loader_reads_it():
    piece = torch.arange(6.0).reshape(2, 3)
    full = place_in_full(piece, (2, 9), engine_slice("model.layers.0.mlp.down_proj.weight", (2, 9),
                                                     EngineGeometry(3, 3, 3, 1, 9), 1))  # fmt: skip
    assert full.shape == (2, 9) and torch.equal(full[:, 3:6], piece)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_an_expert_fed_its_slice_loads_what_the_full_tensor_gives(tp_size):
    """vLLM's ``RoutedExperts._load_w13`` / ``_load_w2`` (no expert parallelism) on one expert, as above."""
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    geometry = EngineGeometry(tp_size=tp_size, num_heads=HEADS, num_kv_heads=2, head_dim=HEAD_DIM, vocab_size=VOCAB)
    g = torch.Generator().manual_seed(tp_size)
    expert = f"{LAYER}.mlp.experts.5"
    gate, up, down = (
        torch.randn(shape, generator=g).double() for shape in ((FFN, HIDDEN), (FFN, HIDDEN), (HIDDEN, FFN))
    )
    config = SimpleNamespace(is_act_and_mul=True, moe_parallel_config=SimpleNamespace(tp_size=tp_size))
    narrow = RoutedExperts._narrow_expert_data_for_padding
    stand_in = SimpleNamespace(moe_config=config, _get_hidden_dim=RoutedExperts._get_hidden_dim,
                               _narrow_expert_data_for_padding=narrow)  # fmt: skip
    for rank in range(tp_size):
        loaded = []
        for fed in ("full", "slice"):
            w13 = torch.zeros(2 * FFN // tp_size, HIDDEN, dtype=torch.float64)
            w2 = torch.zeros(HIDDEN, FFN // tp_size, dtype=torch.float64)
            for shard_id, name, full in (("w1", "gate_proj", gate), ("w3", "up_proj", up)):
                tensor = full if fed == "full" else _only_slice(full, f"{expert}.{name}.weight", geometry, rank)
                RoutedExperts._load_w13(stand_in, w13, 0, shard_id, tensor, rank)
            tensor = down if fed == "full" else _only_slice(down, f"{expert}.down_proj.weight", geometry, rank)
            RoutedExperts._load_w2(stand_in, w2, 1, tensor, rank)
            loaded.append((w13, w2))
        assert torch.equal(loaded[0][0], loaded[1][0]) and torch.equal(loaded[0][1], loaded[1][1]), rank
