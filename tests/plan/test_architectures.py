"""Architecture dimensions: parameter counts against hand arithmetic and against real checkpoints on disk."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from gtpo_megatron.builtin_models import cache_dir
from gtpo_megatron.plan.architectures import (
    KNOWN_ARCHITECTURES,
    architecture_from_hf_config,
    resolve_architecture,
)


def _safetensors_numel(folder: Path) -> int:
    """Independent reference: count every element stored in the checkpoint's safetensors files."""
    total = 0
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                numel = 1
                for dim in f.get_slice(name).get_shape():
                    numel *= dim
                total += numel
    return total


def test_llama_70b_param_count_by_hand() -> None:
    arch = KNOWN_ARCHITECTURES["Llama-3.1-70B-Instruct"]
    # q 8192x8192, k and v 8192x1024 each, o 8192x8192: 67,108,864 + 2*8,388,608 + 67,108,864 = 150,994,944
    attention = 150_994_944
    # gate, up, down: 3 * 8192 * 28672 = 704,643,072; two RMSNorms 2 * 8192 = 16,384
    layer = attention + 704_643_072 + 16_384
    assert arch.layer_params() == layer == 855_654_400
    # 80 layers + final norm 8192 + untied embedding and output layer 2 * 128256 * 8192 = 2,101,346,304
    assert arch.total_params() == 80 * 855_654_400 + 8192 + 2_101_346_304 == 70_553_706_496


def test_qwen3_32b_head_dim_and_qk_norm() -> None:
    arch = KNOWN_ARCHITECTURES["Qwen3-32B"]
    # 64 heads x 128 = 8192 != hidden 5120; q 5120x8192, k/v 5120x1024, o 8192x5120
    attention = 5120 * 8192 + 2 * 5120 * 1024 + 8192 * 5120
    layer = attention + 2 * 128 + 3 * 5120 * 25600 + 2 * 5120
    assert arch.q_width == 8192
    assert arch.layer_params() == layer
    # published size: 32.8B parameters
    assert arch.total_params() == 64 * layer + 5120 + 2 * 151936 * 5120
    assert round(arch.total_params() / 1e9, 1) == 32.8


def test_qwen25_1p5b_param_count_by_hand() -> None:
    arch = KNOWN_ARCHITECTURES["Qwen2.5-1.5B-Instruct"]
    # q 1536x1536 and o 1536x1536, k/v 1536x256 each (2 KV heads x 128): 5,505,024; qkv bias 1536 + 2*256 = 2,048
    # SwiGLU 3 * 1536 * 8960 = 41,287,680; two RMSNorms 3,072 -> 46,797,824 per layer
    assert arch.layer_params() == 5_505_024 + 2_048 + 41_287_680 + 3_072 == 46_797_824
    # 28 layers + final norm 1536 + one tied embedding 151936 * 1536 = 233,373,696: the published 1.54B
    assert arch.total_params() == 28 * 46_797_824 + 1_536 + 233_373_696 == 1_543_714_304


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-llama", "smollm2-135m-instruct"])
def test_local_config_matches_checkpoint(name: str) -> None:
    folder = cache_dir() / name
    if not (folder / "config.json").is_file():
        pytest.skip(f"built-in model {name} is not materialised under {cache_dir()}")
    arch = resolve_architecture(str(folder))
    assert arch.total_params() == _safetensors_numel(folder)


def test_tiny_qwen2_by_hand() -> None:
    folder = cache_dir() / "tiny-qwen2"
    if not (folder / "config.json").is_file():
        pytest.skip("tiny-qwen2 not materialised")
    arch = architecture_from_hf_config(json.loads((folder / "config.json").read_text()), name="tiny-qwen2")
    assert (arch.num_query_groups, arch.head_dim, arch.qkv_bias, arch.tied_embeddings) == (2, 32, True, False)
    # q 128x128 + k,v 128x64 + o 128x128 = 49,152; bias 128+64+64 = 256; mlp 3*128*256 = 98,304; norms 256
    assert arch.layer_params() == 147_968
    assert arch.total_params() == 2 * 147_968 + 128 + 2 * 49152 * 128 == 12_878_976


def test_hub_name_resolves_to_table_and_unknown_name_fails() -> None:
    assert resolve_architecture("meta-llama/Llama-3.1-70B-Instruct").num_layers == 80
    assert resolve_architecture("Qwen/Qwen2.5-32B-Instruct").vocab_size == 152064
    with pytest.raises(ValueError, match="model.name_or_path='org/NotAModel'.*Qwen3-32B"):
        resolve_architecture("org/NotAModel")


def test_missing_key_names_it() -> None:
    with pytest.raises(ValueError, match="intermediate_size"):
        architecture_from_hf_config(
            {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 8, "num_attention_heads": 2,
             "vocab_size": 10}, name="x")  # fmt: skip
