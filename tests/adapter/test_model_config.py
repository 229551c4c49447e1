"""HF config -> Megatron ``TransformerConfig`` / GPTModel arguments, and the CPU shim (single process)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config, Qwen3Config

from gtpo_megatron.config import ParallelConfig
from gtpo_megatron.megatron_adapter import cpu_compat
from gtpo_megatron.megatron_adapter.hf_features import rope_settings
from gtpo_megatron.megatron_adapter.model import transformer_config_from_hf
from gtpo_megatron.megatron_adapter.settings import PolicySettings
from tests.adapter.megatron_helpers import model_section
from tests.helpers.tiny_configs import SMALL


def _settings(tp: int = 1, pp: int = 1, **model_fields) -> PolicySettings:
    return PolicySettings(model=model_section("x", **model_fields), parallel=ParallelConfig(tp_size=tp, pp_size=pp))


def test_architecture_flags():
    def build(hf, tp=2, pp=2):
        return transformer_config_from_hf(hf, _settings(tp, pp))

    llama, qwen2 = build(LlamaConfig(**SMALL)), build(Qwen2Config(**SMALL))
    assert (llama.add_qkv_bias, qwen2.add_qkv_bias) == (False, True)
    assert llama.num_query_groups == 2 and llama.kv_channels == 16 and llama.gated_linear_unit
    assert llama.normalization == "RMSNorm" and llama.layernorm_epsilon == 1e-6
    qwen3 = build(Qwen3Config(**SMALL, head_dim=32))
    assert qwen3.qk_layernorm and qwen3.kv_channels == 32
    bf16 = transformer_config_from_hf(LlamaConfig(**SMALL), _settings(params_dtype="bfloat16"))
    assert bf16.bf16 and bf16.params_dtype == torch.bfloat16


def test_invalid_layouts_name_the_field():
    with pytest.raises(ValueError, match="num_key_value_heads=2 must both be divisible by tp_size=4"):
        transformer_config_from_hf(LlamaConfig(**SMALL), _settings(tp=4))
    with pytest.raises(ValueError, match="num_hidden_layers=4 is not divisible by pp_size=3"):
        transformer_config_from_hf(LlamaConfig(**SMALL), _settings(pp=3))
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        transformer_config_from_hf(LlamaConfig(**SMALL, hidden_act="gelu"), _settings())


def test_head_padding_config_and_error():
    """SmolLM2's shape (9 heads, 3 KV groups, head_dim 64, hidden 576) at TP=2: 4 groups x 3 heads with padding,
    a ValueError naming both fields, the option and the valid tp sizes without it."""
    from gtpo_megatron.megatron_adapter.hf_conversion import ModelGeometry

    smollm2 = LlamaConfig(**{**SMALL, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3})
    with pytest.raises(ValueError) as error:
        transformer_config_from_hf(smollm2, _settings(tp=2))
    for part in (
        "num_attention_heads=9",
        "num_key_value_heads=3",
        "tp_size=2",
        "model.pad_attention_heads=true",
        "4 KV groups (12 heads)",
        "[1, 3]",
    ):
        assert part in str(error.value), (part, str(error.value))
    config = transformer_config_from_hf(smollm2, _settings(tp=2, pad_attention_heads=True))
    assert (config.num_attention_heads, config.num_query_groups, config.kv_channels) == (12, 4, 64)
    geometry = ModelGeometry.from_hf(smollm2, padded_vocab_size=1024, tp_size=2, pad_attention_heads=True)
    assert (geometry.num_heads, geometry.num_query_groups, geometry.num_pad_groups) == (9, 3, 1)
    assert (geometry.padded_num_heads, geometry.padded_num_query_groups) == (12, 4)
    for tp in (1, 3):  # divisible: padding is a no-op
        same = transformer_config_from_hf(smollm2, _settings(tp=tp, pad_attention_heads=True))
        assert (same.num_attention_heads, same.num_query_groups) == (9, 3)
    mha = ModelGeometry.from_hf(
        LlamaConfig(**{**SMALL, "num_attention_heads": 5, "num_key_value_heads": 5, "hidden_size": 80}),
        padded_vocab_size=1024,
        tp_size=4,
        pad_attention_heads=True,
    )
    assert (mha.padded_num_query_groups, mha.padded_num_heads) == (8, 8)


def test_head_padding_of_another_tp_layout():
    """A padded TP=2 run (SmolLM2: 3 -> 4 KV groups) exported or resumed at TP=1 or TP=4 keeps 4 groups; without
    pad_attention_heads the argument changes nothing."""
    from gtpo_megatron.megatron_adapter.head_padding import padded_num_query_groups

    def groups(tp, padding_tp, pad=True, num_groups=3):
        return padded_num_query_groups(
            num_heads=3 * num_groups,
            num_query_groups=num_groups,
            tp_size=tp,
            pad_attention_heads=pad,
            padding_tp_size=padding_tp,
        )

    assert [groups(1, 2), groups(2, 2), groups(4, 2), groups(1, None), groups(3, 2)] == [4, 4, 4, 3, 6]
    assert groups(1, 2, pad=False) == 3 and groups(2, 2, num_groups=4) == 4


def test_rope_settings():
    assert rope_settings(Qwen2Config(**SMALL, rope_theta=1e6)) == {"rotary_base": 1e6, "rope_scaling": False}
    llama3 = {
        "rope_type": "llama3",
        "rope_theta": 5e5,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert rope_settings(LlamaConfig(**SMALL, rope_parameters=llama3)) == {
        "rotary_base": 5e5,
        "rope_scaling": True,
        "rope_scaling_factor": 32.0,
    }
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        rope_settings(LlamaConfig(**SMALL, rope_parameters={**llama3, "original_max_position_embeddings": 4096}))
    with pytest.raises(ValueError, match="rope_type='yarn'"):
        rope_settings(LlamaConfig(**SMALL, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}))


def test_llama3_rope_frequencies_match_transformers():
    """Megatron's RoPE built from ``rope_settings`` has exactly HF's Llama-3 scaled inverse frequencies (a logits
    test cannot see this: at short lengths the scaled low frequencies barely rotate)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    llama3 = {
        "rope_type": "llama3",
        "rope_theta": 5e5,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config = LlamaConfig(**{**SMALL, "hidden_size": 256}, max_position_embeddings=131072, rope_parameters=llama3)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    rotary = RotaryEmbedding(kv_channels=64, rotary_percent=1.0, use_cpu_initialization=True, **rope_settings(config))
    assert torch.equal(rotary.inv_freq, expected.to(rotary.inv_freq.dtype))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU shim")
def test_cpu_shim_redirects_cuda_only_inside_the_mode(monkeypatch):
    from megatron.core.tensor_parallel import random as megatron_random

    # restore every patched attribute after the test so other tests in this process see stock torch.cuda
    for attr in (
        "current_stream",
        "default_stream",
        "current_device",
        "synchronize",
        "empty_cache",
        "get_rng_state",
        "set_rng_state",
        "manual_seed",
    ):
        monkeypatch.setattr(torch.cuda, attr, getattr(torch.cuda, attr))
    for attr in ("_get_cuda_rng_state", "_set_cuda_rng_state"):
        monkeypatch.setattr(megatron_random, attr, getattr(megatron_random, attr))
    monkeypatch.setattr(cpu_compat, "_installed", False)
    assert cpu_compat.install_cpu_compat() is True
    assert torch.cuda.current_device() == torch.device("cpu")
    with cpu_compat.cuda_to_cpu_mode():
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        tensor = torch.ones(3)
        assert tensor.cuda() is tensor and tensor.to("cuda").device.type == "cpu"
        assert tensor.type() == "torch.cuda.FloatTensor"
    assert torch.ones(3).type() == "torch.FloatTensor"


def test_cpu_shim_is_inert_with_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu_compat.install_cpu_compat() is False
    assert isinstance(cpu_compat.cuda_to_cpu_mode(), type(__import__("contextlib").nullcontext()))


def test_fp32_output_layer_refuses_gradient_accumulation_fusion():
    from types import SimpleNamespace

    from gtpo_megatron.megatron_adapter.output_layer import use_fp32_output_layer

    layer = SimpleNamespace(config=SimpleNamespace(gradient_accumulation_fusion=True))
    with pytest.raises(ValueError, match="fp32_output_layer=True cannot be combined with gradient_accumulation"):
        use_fp32_output_layer(layer)
