"""HF <-> Megatron shard layout (``megatron_adapter.hf_conversion``), single process, tiny literal shapes.

Every expected Megatron shard is built here by explicit loops from the definition in Megatron's docs
(per-query-group QKV rows, per-rank gate-then-up rows, vocabulary rows padded with zeros), not with the module's
reshapes; the round trip HF -> shards -> HF must be ``torch.equal``.
"""

from __future__ import annotations

import os
import stat

import pytest
import torch
from safetensors.torch import save_file

from gtpo_megatron.megatron_adapter import hf_conversion as hc
from gtpo_megatron.megatron_adapter import hf_loading

Q, G, D, H, F, VOCAB, PADDED = 8, 4, 3, 5, 8, 10, 12  # heads, KV groups, head_dim, hidden, ffn, vocab, padded


def _hf_tensors(tied: bool, heads: int = Q, groups: int = G) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    layer = "model.layers.1."
    tensors = {
        "model.embed_tokens.weight": rand(VOCAB, H),
        "model.norm.weight": rand(H),
        layer + "input_layernorm.weight": rand(H),
        layer + "post_attention_layernorm.weight": rand(H),
        layer + "self_attn.q_proj.weight": rand(heads * D, H),
        layer + "self_attn.k_proj.weight": rand(groups * D, H),
        layer + "self_attn.v_proj.weight": rand(groups * D, H),
        layer + "self_attn.q_proj.bias": rand(heads * D),
        layer + "self_attn.k_proj.bias": rand(groups * D),
        layer + "self_attn.v_proj.bias": rand(groups * D),
        layer + "self_attn.o_proj.weight": rand(H, heads * D),
        layer + "mlp.gate_proj.weight": rand(F, H),
        layer + "mlp.up_proj.weight": rand(F, H),
        layer + "mlp.down_proj.weight": rand(H, F),
    }
    if not tied:
        tensors["lm_head.weight"] = rand(VOCAB, H)
    return tensors


MEGATRON_NAMES = [
    "embedding.word_embeddings.weight",
    "output_layer.weight",
    "decoder.final_layernorm.weight",
    "decoder.layers.1.input_layernorm.weight",
    "decoder.layers.1.self_attention.linear_qkv.weight",
    "decoder.layers.1.self_attention.linear_qkv.bias",
    "decoder.layers.1.self_attention.linear_proj.weight",
    "decoder.layers.1.pre_mlp_layernorm.weight",
    "decoder.layers.1.mlp.linear_fc1.weight",
    "decoder.layers.1.mlp.linear_fc2.weight",
]


def _geometry(tp: int, tied: bool = False) -> hc.ModelGeometry:
    return hc.ModelGeometry(
        num_heads=Q,
        num_query_groups=G,
        head_dim=D,
        vocab_size=VOCAB,
        padded_vocab_size=PADDED,
        tie_word_embeddings=tied,
        tp_size=tp,
    )


@pytest.fixture(params=[False, True], ids=["untied", "tied"])
def checkpoint(request, tmp_path):
    tensors = _hf_tensors(tied=request.param)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return tensors, hf_loading.HFCheckpointReader(tmp_path), request.param


def _expected_qkv(t: dict[str, torch.Tensor], suffix: str, tp: int, rank: int) -> torch.Tensor:
    """Megatron's layout by definition: for each KV group of this rank, its query heads, its key, its value."""
    q, k, v = (t[f"model.layers.1.self_attn.{p}_proj.{suffix}"] for p in "qkv")
    return _fused_qkv_rows(q, k, v, Q, G, tp, rank)


def _fused_qkv_rows(q, k, v, heads: int, groups: int, tp: int, rank: int) -> torch.Tensor:
    per_group, rows = heads // groups, []
    for g in range(rank * groups // tp, (rank + 1) * groups // tp):
        for h in range(g * per_group, (g + 1) * per_group):
            rows.append(q[h * D : (h + 1) * D])
        rows += [k[g * D : (g + 1) * D], v[g * D : (g + 1) * D]]
    return torch.cat(rows)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shards_follow_megatron_layout(checkpoint, tp):
    tensors, reader, tied = checkpoint
    geometry = _geometry(tp, tied)
    rows, ffn = PADDED // tp, F // tp
    for rank in range(tp):

        def shard(name, rank=rank):
            return hf_loading.shard_from_hf(hc.param_mapping(name, geometry), reader, geometry, rank)

        for suffix in ("weight", "bias"):
            got = shard(f"decoder.layers.1.self_attention.linear_qkv.{suffix}")
            assert torch.equal(got, _expected_qkv(tensors, suffix, tp, rank))
        gate, up = tensors["model.layers.1.mlp.gate_proj.weight"], tensors["model.layers.1.mlp.up_proj.weight"]
        expected_fc1 = torch.cat([gate[rank * ffn : (rank + 1) * ffn], up[rank * ffn : (rank + 1) * ffn]])
        assert torch.equal(shard("decoder.layers.1.mlp.linear_fc1.weight"), expected_fc1)
        down = tensors["model.layers.1.mlp.down_proj.weight"]
        assert torch.equal(shard("decoder.layers.1.mlp.linear_fc2.weight"), down[:, rank * ffn : (rank + 1) * ffn])
        head = tensors["model.embed_tokens.weight" if tied else "lm_head.weight"]
        padded_head = torch.cat([head, torch.zeros(PADDED - VOCAB, H)])
        assert torch.equal(shard("output_layer.weight"), padded_head[rank * rows : (rank + 1) * rows])


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_round_trip_is_exact(checkpoint, tp):
    tensors, reader, tied = checkpoint
    geometry = _geometry(tp, tied)  # tp=4: the last rank holds 1 real and 2 padded vocabulary rows
    rebuilt = {}
    for name in MEGATRON_NAMES:
        mapping = hc.param_mapping(name, geometry)
        shards = [hf_loading.shard_from_hf(mapping, reader, geometry, r) for r in range(geometry.tp_size)]
        if mapping.exported:
            for hf_name, tensor in hc.hf_from_shards(mapping, shards, geometry):
                assert hf_name not in rebuilt
                rebuilt[hf_name] = tensor
    assert rebuilt.keys() == tensors.keys()
    assert all(torch.equal(rebuilt[k], tensors[k]) for k in tensors)


@pytest.mark.parametrize("heads,groups,tp,padded", [(6, 3, 2, 4), (6, 3, 4, 4), (5, 5, 4, 8)])
def test_head_padding_layout_and_round_trip(tmp_path, heads, groups, tp, padded):
    """Padded groups are zero rows appended after the HF groups (QKV) and zero o_proj columns; export drops them.

    (5, 5, 4): multi-head attention padded 5 -> 8 groups; the last TP rank holds only padded groups."""
    tensors = _hf_tensors(tied=True, heads=heads, groups=groups)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    reader = hf_loading.HFCheckpointReader(tmp_path)
    geometry = hc.ModelGeometry(
        num_heads=heads,
        num_query_groups=groups,
        head_dim=D,
        vocab_size=VOCAB,
        padded_vocab_size=PADDED,
        tie_word_embeddings=True,
        tp_size=tp,
        num_pad_groups=padded - groups,
    )
    padded_heads = padded * heads // groups
    layer = "model.layers.1.self_attn."
    for suffix in ("weight", "bias"):
        q, k, v = (tensors[f"{layer}{p}_proj.{suffix}"] for p in "qkv")
        q, k, v = (
            torch.cat([t, t.new_zeros(n * D, *t.shape[1:])])
            for t, n in ((q, padded_heads - heads), (k, padded - groups), (v, padded - groups))
        )
        for rank in range(tp):
            mapping = hc.param_mapping(f"decoder.layers.1.self_attention.linear_qkv.{suffix}", geometry)
            expected = _fused_qkv_rows(q, k, v, padded_heads, padded, tp, rank)
            assert torch.equal(hf_loading.shard_from_hf(mapping, reader, geometry, rank), expected)
    o_proj = torch.cat([tensors[layer + "o_proj.weight"], torch.zeros(H, (padded_heads - heads) * D)], dim=1)
    cols = padded_heads * D // tp
    proj = hc.param_mapping("decoder.layers.1.self_attention.linear_proj.weight", geometry)
    for rank in range(tp):
        expected = o_proj[:, rank * cols : (rank + 1) * cols]
        assert torch.equal(hf_loading.shard_from_hf(proj, reader, geometry, rank), expected)
    rebuilt = {}
    for name in MEGATRON_NAMES:
        mapping = hc.param_mapping(name, geometry)
        if mapping.exported:
            shards = [hf_loading.shard_from_hf(mapping, reader, geometry, r) for r in range(tp)]
            rebuilt.update(hc.hf_from_shards(mapping, shards, geometry))
    assert rebuilt.keys() == tensors.keys()
    assert all(torch.equal(rebuilt[k], tensors[k]) for k in tensors)


def test_names_and_errors():
    geometry = _geometry(1, tied=True)
    local = "decoder.layers.0.mlp.linear_fc2.weight"
    assert hc.global_param_name(local, 15) == "decoder.layers.15.mlp.linear_fc2.weight"
    assert hc.global_param_name("output_layer.weight", 15) == "output_layer.weight"
    tied_head = hc.param_mapping("output_layer.weight", geometry)
    assert tied_head.hf_names == ("model.embed_tokens.weight",) and not tied_head.exported
    te_norm = hc.param_mapping("decoder.layers.3.self_attention.linear_qkv.layer_norm_weight", geometry)
    assert te_norm.hf_names == ("model.layers.3.input_layernorm.weight",)
    with pytest.raises(ValueError, match="no Hugging Face mapping"):
        hc.param_mapping("decoder.layers.0.mlp.router.weight", geometry)


def test_sharded_export_reads_back(tmp_path):
    """``write_hf_folder`` splits into several safetensors files plus an index, which the reader follows."""
    from transformers import LlamaConfig

    from gtpo_megatron.megatron_adapter.hf_export import write_hf_folder

    tensors = _hf_tensors(tied=False)
    out = tmp_path / "export"
    write_hf_folder(
        iter(tensors.items()), out, hf_config=LlamaConfig(), tokenizer_source=None, write=True, max_shard_bytes=400
    )
    assert len(list(out.glob("model-*.safetensors"))) > 1 and (out / "model.safetensors.index.json").exists()
    assert (out / "config.json").exists() and not list(tmp_path.glob(".export-*"))
    reader = hf_loading.HFCheckpointReader(out)
    assert all(torch.equal(reader.read(name), tensor) for name, tensor in tensors.items())
    assert torch.equal(reader.read("lm_head.weight", 0, 2, 5), tensors["lm_head.weight"][2:5])


@pytest.mark.parametrize(("umask", "folder_mode", "file_mode"), [(0o022, 0o755, 0o644), (0o077, 0o700, 0o600)])
def test_export_takes_the_umasks_modes(tmp_path, umask, folder_mode, file_mode):
    """mkdtemp's 0700 and safetensors' 0600 are replaced by 0777 / 0666 less the umask before the rename."""
    from transformers import LlamaConfig

    from gtpo_megatron.megatron_adapter.hf_export import write_hf_folder

    out, previous = tmp_path / "export", os.umask(umask)
    try:
        write_hf_folder(iter(_hf_tensors(tied=False).items()), out, hf_config=LlamaConfig(), tokenizer_source=None,
                        write=True, max_shard_bytes=400)  # fmt: skip
    finally:
        os.umask(previous)
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in [out, *out.iterdir()]}
    assert modes.pop("export") == folder_mode and "model.safetensors.index.json" in modes
    assert set(modes.values()) == {file_mode}
