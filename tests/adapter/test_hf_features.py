"""``megatron_adapter.hf_features``: every HF config field that changes the math is mapped or refused (single
process; the logits parity of each supported feature against ``transformers`` is in
``tests/distributed/test_hf_features_parity.py``)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from transformers import (
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from gtpo_megatron.config import ParallelConfig
from gtpo_megatron.megatron_adapter.hf_features import (
    LinearBiases,
    check_hf_config,
    has_qk_norm,
    linear_biases,
    rope_settings,
    sliding_window_settings,
)
from gtpo_megatron.megatron_adapter.model import transformer_config_from_hf
from gtpo_megatron.megatron_adapter.settings import PolicySettings
from gtpo_megatron.plan.architectures import architecture_from_hf_config
from tests.adapter.megatron_helpers import model_section
from tests.helpers.tiny_configs import SMALL


def test_linear_biases_follow_the_transformers_classes():
    assert linear_biases(LlamaConfig(**SMALL)) == LinearBiases(qkv=False, proj=False, mlp=False)
    assert linear_biases(LlamaConfig(**SMALL, attention_bias=True)) == LinearBiases(qkv=True, proj=True, mlp=False)
    assert linear_biases(LlamaConfig(**SMALL, mlp_bias=True)) == LinearBiases(qkv=False, proj=False, mlp=True)
    assert linear_biases(Qwen2Config(**SMALL)) == LinearBiases(qkv=True, proj=False, mlp=False)
    assert linear_biases(Qwen3Config(**SMALL, attention_bias=True)) == LinearBiases(qkv=True, proj=True, mlp=False)
    # transformers' Mistral and Qwen2 classes ignore these keys, so the Megatron model does too
    ignored = MistralConfig(**SMALL)
    ignored.attention_bias, ignored.mlp_bias = True, True
    assert linear_biases(ignored) == LinearBiases(qkv=False, proj=False, mlp=False)


@pytest.mark.parametrize(
    ("hf_config", "qkv_bias", "qk_norm"),
    [
        (LlamaConfig(**SMALL, attention_bias=True), True, False),
        (MistralConfig(**SMALL), False, False),
        (Qwen2Config(**SMALL), True, False),
        (Qwen3Config(**SMALL), False, True),
        (Qwen3MoeConfig(**SMALL, num_experts=4), False, True),
        (Qwen2MoeConfig(**SMALL, num_experts=4, qkv_bias=False), False, False),
        (MixtralConfig(**SMALL, num_local_experts=4), False, False),
    ],
)
def test_the_planner_counts_the_biases_and_norms_the_model_builds(hf_config, qkv_bias, qk_norm):
    arch = architecture_from_hf_config(hf_config.to_dict(), name="x")
    assert (arch.qkv_bias, arch.qk_norm) == (qkv_bias, qk_norm)
    assert (linear_biases(hf_config).qkv, has_qk_norm(hf_config)) == (qkv_bias, qk_norm)


def test_sliding_window_settings():
    # HF attends to kv > q - W, i.e. itself and W - 1 earlier tokens: Megatron's (left, right) = (W - 1, 0)
    assert sliding_window_settings(MistralConfig(**SMALL, sliding_window=4096)) == {"window_size": (4095, 0)}
    assert sliding_window_settings(MistralConfig(**SMALL, sliding_window=None)) == {}
    assert sliding_window_settings(Qwen2Config(**SMALL, sliding_window=4096)) == {}  # use_sliding_window=False
    assert sliding_window_settings(
        Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=64, max_window_layers=2)
    ) == {"window_size": (63, 0), "window_attn_skip_freq": [0, 0, 1, 1]}
    assert sliding_window_settings(
        Qwen3Config(**SMALL, use_sliding_window=True, sliding_window=8, max_window_layers=0)
    ) == {"window_size": (7, 0)}
    assert sliding_window_settings(LlamaConfig(**SMALL)) == {}
    chunked = SimpleNamespace(
        model_type="qwen2", sliding_window=8, num_hidden_layers=2, layer_types=["full_attention", "chunked_attention"]
    )
    with pytest.raises(ValueError, match=r"layer_types contains \['chunked_attention'\]"):
        sliding_window_settings(chunked)


def test_transformer_config_carries_biases_and_windows():
    def build(hf):
        return transformer_config_from_hf(
            hf, PolicySettings(model=model_section("x"), parallel=ParallelConfig(tp_size=2, pp_size=2))
        )

    llama = build(LlamaConfig(**SMALL, attention_bias=True, mlp_bias=True))
    # q/k/v through add_qkv_bias; o_proj and MLP biases through per-module classes, never add_bias_linear
    assert llama.add_qkv_bias and not llama.add_bias_linear and llama.window_size is None
    qwen2 = build(Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=16, max_window_layers=3))
    assert (qwen2.window_size, qwen2.window_attn_skip_freq) == ((15, 0), [0, 0, 0, 1])
    mistral = build(MistralConfig(**SMALL, sliding_window=32))
    assert (mistral.window_size, mistral.window_attn_skip_freq, mistral.add_qkv_bias) == ((31, 0), None, False)


def test_layer_spec_biases():
    from gtpo_megatron.megatron_adapter.model import mlp_submodules, select_layer_spec

    spec, _ = select_layer_spec(qk_layernorm=False, biases=LinearBiases(qkv=True, proj=True, mlp=False))
    attention, mlp = spec.submodules.self_attention.submodules, mlp_submodules(spec.submodules.mlp)
    assert attention.linear_proj.__name__.startswith("Biased")
    assert not mlp.linear_fc1.__name__.startswith("Biased") and not mlp.linear_fc2.__name__.startswith("Biased")
    plain, _ = select_layer_spec(qk_layernorm=False, biases=LinearBiases(qkv=False, proj=False, mlp=True))
    assert mlp_submodules(plain.submodules.mlp).linear_fc2.__name__.startswith("Biased")
    assert not plain.submodules.self_attention.submodules.linear_proj.__name__.startswith("Biased")


def test_rope_variants():
    linear = LlamaConfig(**SMALL, rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4})
    assert rope_settings(linear) == {"rotary_base": 1e4, "rope_scaling": False, "seq_len_interpolation_factor": 4.0}
    for rope_type in ("dynamic", "longrope", "yarn"):
        config = SimpleNamespace(model_type="llama", rope_parameters={"rope_type": rope_type, "factor": 2.0})
        with pytest.raises(ValueError, match=f"rope_type='{rope_type}' is not supported"):
            rope_settings(config)
    partial = SimpleNamespace(
        model_type="llama", rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}
    )
    with pytest.raises(ValueError, match="partial_rotary_factor=0.5 is not supported for model_type='llama'"):
        check_hf_config(SimpleNamespace(**vars(partial), hidden_act="silu"))


def test_linear_rope_frequencies_match_transformers():
    """Megatron's RoPE angles with ``seq_len_interpolation_factor`` equal HF's linear-scaled ones."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(**SMALL, rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4})
    inv_freq, _ = ROPE_INIT_FUNCTIONS["linear"](config, "cpu")
    expected = torch.outer(torch.arange(64, dtype=torch.float32), inv_freq.float())
    rotary = RotaryEmbedding(kv_channels=16, rotary_percent=1.0, use_cpu_initialization=True, **rope_settings(config))
    torch.testing.assert_close(rotary.get_freqs_non_repeated(64), expected, atol=1e-5, rtol=1e-6)


def test_refusals_and_warnings(caplog):
    with pytest.raises(ValueError, match="model_type='gemma2' is not supported"):
        check_hf_config(SimpleNamespace(model_type="gemma2"))
    with pytest.raises(ValueError, match="hidden_act='gelu_pytorch_tanh'"):
        check_hf_config(LlamaConfig(**SMALL, hidden_act="gelu_pytorch_tanh"))
    with caplog.at_level(logging.WARNING):
        check_hf_config(LlamaConfig(**SMALL, attention_dropout=0.1))
        check_hf_config(MixtralConfig(**SMALL, router_jitter_noise=0.01))
    assert "attention_dropout=0.1" in caplog.text and "router_jitter_noise=0.01" in caplog.text
