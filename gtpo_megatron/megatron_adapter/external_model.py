"""A caller's own ``GPTModel`` seen by the HF converter: its ``ModelGeometry``, or a refusal that names what fails.

Decoders of ``plan.model_families.SUPPORTED_MODEL_TYPES`` built as Megatron's GPT block (local or TE spec; MoE
layers for the MoE types) are accepted; anything else (MLA, extra modules, sizes or expert counts that disagree with
the HF config) is refused before any weight moves.
"""

from __future__ import annotations

from gtpo_megatron.megatron_adapter.hf_conversion import ModelGeometry, global_named_parameters, param_mapping
from gtpo_megatron.megatron_adapter.hf_features import check_hf_config
from gtpo_megatron.plan.model_families import SUPPORTED_MODEL_TYPES

_CONVERTER = "gtpo_megatron/megatron_adapter/hf_conversion.py"


def unwrap_model(model):
    """The ``GPTModel`` inside Megatron's wrappers (``DistributedDataParallel``, ``Float16Module``)."""
    while not hasattr(model, "decoder") and hasattr(model, "module"):
        model = model.module
    return model


def model_geometry(model, hf_config, *, tp_size: int) -> ModelGeometry:
    """The conversion geometry of a caller's unwrapped ``GPTModel`` stage for ``hf_config``, after checking they agree.

    Raises:
        ValueError: an HF config the converter refuses, parameters it cannot map (named), or sizes that differ
            between ``model.config`` and ``hf_config`` (each named with both values).
    """
    try:
        check_hf_config(hf_config)
    except ValueError as err:
        raise ValueError(
            f"weight sync cannot convert this model: {err} (Hugging Face converter: {_CONVERTER})"
        ) from err
    geometry = ModelGeometry.from_hf(hf_config, padded_vocab_size=model.vocab_size, tp_size=tp_size)
    _check_mapped(model, geometry)
    _check_sizes(model, hf_config, geometry)
    return geometry


def _check_mapped(model, geometry: ModelGeometry) -> None:
    unmapped = []
    for name, _ in global_named_parameters(model):
        try:
            param_mapping(name, geometry)
        except ValueError:
            unmapped.append(name)
    if unmapped:
        raise ValueError(
            f"weight sync cannot convert {unmapped[:6]}{' ...' if len(unmapped) > 6 else ''}: the Hugging Face "
            f"converter ({_CONVERTER}) maps the GPT block of {list(SUPPORTED_MODEL_TYPES)} models only; "
            "build the model as one of those (MLA and extra modules are not supported)"
        )


def _check_sizes(model, hf_config, geometry: ModelGeometry) -> None:
    config = model.config
    pairs = {
        "num_layers / num_hidden_layers": (config.num_layers, hf_config.num_hidden_layers),
        "hidden_size": (config.hidden_size, hf_config.hidden_size),
        "ffn_hidden_size / intermediate_size": (config.ffn_hidden_size, hf_config.intermediate_size),
        "num_attention_heads": (config.num_attention_heads, geometry.padded_num_heads),
        "num_query_groups / num_key_value_heads": (
            config.num_query_groups or config.num_attention_heads,
            geometry.padded_num_query_groups,
        ),
        "kv_channels / head_dim": (config.kv_channels, geometry.head_dim),
        "share_embeddings_and_output_weights / tie_word_embeddings": (
            bool(model.share_embeddings_and_output_weights),
            geometry.tie_word_embeddings,
        ),
    }
    moe = geometry.moe
    pairs["num_moe_experts / num_experts"] = (config.num_moe_experts, moe.num_experts if moe else None)
    if moe is not None:
        pairs["moe_ffn_hidden_size / moe_intermediate_size"] = (config.moe_ffn_hidden_size, moe.expert_ffn_size)
        pairs["moe_router_topk / num_experts_per_tok"] = (config.moe_router_topk, moe.top_k)
        # the renormalised HF top-k is Megatron's top-k then softmax (moe.features)
        pairs["moe_router_pre_softmax / not renormalised top-k"] = (config.moe_router_pre_softmax, not moe.renormalize)
    wrong = [f"{name}: model {ours} vs HF {theirs}" for name, (ours, theirs) in pairs.items() if ours != theirs]
    if model.vocab_size < hf_config.vocab_size:
        wrong.append(f"vocab_size: model {model.vocab_size} rows < HF {hf_config.vocab_size}")
    if wrong:
        raise ValueError(
            f"the GPTModel does not match the HF config the engine serves ({'; '.join(wrong)}); build the model "
            "from that config or give the engine the config of this model"
        )
