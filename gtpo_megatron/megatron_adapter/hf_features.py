"""What each Hugging Face config field of the accepted decoders does, and how Megatron reproduces it (or refuses it).

The field-by-field table (Llama, Mistral, Qwen2, Qwen3; the fields their ``transformers`` modeling code reads) is
in docs/models.md; the mixture-of-experts types (Qwen3-MoE, Qwen2-MoE, Mixtral) share their attention fields and add
the router's (``moe.features``, docs/moe.md); what differs between the types is their ``plan.model_families``
record. Nothing is dropped silently: a field that cannot be built raises ValueError at load.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from gtpo_megatron.megatron_adapter.moe.features import check_moe_config
from gtpo_megatron.plan.model_families import FAMILIES, SUPPORTED_MODEL_TYPES

logger = logging.getLogger(__name__)

_TRAINING_ONLY = {
    "attention_dropout": "the policy trains without dropout",
    "router_jitter_noise": "the policy routes without input jitter",
}
"""HF fields that act in training mode only, with what the policy does instead (RL fine-tuning: neither)."""
_LLAMA3_CONSTANTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class LinearBiases:
    """Which linear layers of a decoder layer have biases: fused q/k/v, o_proj, the MLP."""

    qkv: bool
    proj: bool
    mlp: bool


def linear_biases(hf_config) -> LinearBiases:
    """The biases ``transformers`` builds for ``hf_config`` (its family's flags)."""
    family, config = FAMILIES[hf_config.model_type], hf_config.to_dict()
    return LinearBiases(
        qkv=family.qkv_bias.read(config), proj=family.proj_bias.read(config), mlp=family.mlp_bias.read(config)
    )


def has_qk_norm(hf_config) -> bool:
    """True for the families with q/k RMSNorms (qwen3, qwen3_moe)."""
    return FAMILIES[hf_config.model_type].qk_norm


def sliding_window_settings(hf_config) -> dict:
    """``TransformerConfig`` kwargs for HF's sliding windows: ``window_size = (W - 1, 0)``, a skip list if mixed.

    Raises:
        ValueError: a ``layer_types`` entry other than ``full_attention`` / ``sliding_attention``, or a window < 1.
    """
    window, where = getattr(hf_config, "sliding_window", None), FAMILIES[hf_config.model_type].windows
    if where == "every_layer":
        windowed = [window is not None] * hf_config.num_hidden_layers
    elif where == "layer_types":
        layer_types = list(getattr(hf_config, "layer_types", None) or [])
        unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(
                f"layer_types contains {unknown}: only full_attention and sliding_attention layers "
                "can be built; use a checkpoint without them"
            )
        windowed = [window is not None and kind == "sliding_attention" for kind in layer_types]
    else:
        windowed = []
    if not any(windowed):
        return {}
    if window < 1:
        raise ValueError(f"sliding_window={window} must be >= 1 (or null for full attention)")
    settings = {"window_size": (int(window) - 1, 0)}
    if not all(windowed):
        settings["window_attn_skip_freq"] = [int(flag) for flag in windowed]
    return settings


def _rope_parameters(hf_config) -> dict:
    legacy_scaling = getattr(hf_config, "rope_scaling", None) or {}
    return {**legacy_scaling, **dict(getattr(hf_config, "rope_parameters", None) or {})}


def rope_settings(hf_config) -> dict:
    """GPTModel RoPE keyword arguments (base; linear or Llama-3 scaling) from an HF config.

    Raises:
        ValueError: a rope type Megatron's GPTModel cannot express (e.g. ``yarn``, ``dynamic``, ``longrope``),
            Llama-3 scaling constants other than Megatron's fixed ones, or a partial rotary embedding.
    """
    params = _rope_parameters(hf_config)
    partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
    if float(partial) != 1.0:
        raise ValueError(
            f"partial_rotary_factor={partial} is not supported for model_type="
            f"{hf_config.model_type!r} (RoPE covers every head dimension here); use a checkpoint "
            "without it"
        )
    base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    settings = {"rotary_base": base, "rope_scaling": False}
    if rope_type == "default":
        return settings
    if rope_type == "linear":
        return {**settings, "seq_len_interpolation_factor": float(params["factor"])}
    if rope_type != "llama3":
        raise ValueError(
            f"rope_parameters.rope_type={rope_type!r} is not supported by Megatron's GPTModel here "
            "(default, linear and llama3 are); use a checkpoint with one of those"
        )
    for key, expected in _LLAMA3_CONSTANTS.items():
        if float(params.get(key, expected)) != expected:
            raise ValueError(
                f"rope_parameters.{key}={params[key]} differs from Megatron's fixed {expected} for "
                "llama3 RoPE; such a checkpoint cannot be built exactly"
            )
    return {**settings, "rope_scaling": True, "rope_scaling_factor": float(params.get("factor", 8.0))}


def check_hf_config(hf_config) -> None:
    """Refuse, at load, every field that cannot be built; warn about those without effect.

    Raises:
        ValueError: unsupported ``model_type`` or ``hidden_act``, and the errors of ``rope_settings``,
            ``sliding_window_settings`` and ``moe.features.check_moe_config``.
    """
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type={model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(
            f"hidden_act={hf_config.hidden_act!r}: only SiLU-gated MLPs (SwiGLU) are supported; "
            "use a checkpoint with hidden_act='silu'"
        )
    rope_settings(hf_config)
    sliding_window_settings(hf_config)
    if FAMILIES[model_type].moe:
        check_moe_config(hf_config)
    for field, behaviour in _TRAINING_ONLY.items():
        value = float(getattr(hf_config, field, 0.0) or 0.0)
        if value > 0:
            logger.warning(
                "%s=%s in the HF config has no effect: %s (as transformers and vLLM evaluate)", field, value, behaviour
            )
