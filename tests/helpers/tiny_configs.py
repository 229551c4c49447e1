"""The tiny Hugging Face model sizes the tests build: config-only tests (``SMALL``) and random models (``TINY``)."""

from __future__ import annotations

SMALL = dict(
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
)
"""Config-only tests (no weights): 4 layers and 4 heads (2 KV heads), so that tp=2 with pp=2 divides them."""

TINY = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
"""The distributed tests' random models: 2 layers, 4 heads (2 KV heads), for tp 2 or pp 2."""


def tiny_llama(**fields):
    """A ``LlamaConfig`` of ``TINY`` sizes, ``fields`` overriding them."""
    from transformers import LlamaConfig

    return LlamaConfig(**{**TINY, **fields})


def tiny_qwen3(**fields):
    """A ``Qwen3Config`` of ``TINY`` sizes with q/k norms, head_dim 32 (!= hidden/heads) and tied embeddings."""
    from transformers import Qwen3Config

    return Qwen3Config(**{**TINY, "head_dim": 32, "tie_word_embeddings": True, **fields})


EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
"""The distributed MoE tests' experts: 4 a layer, top-2, width 32."""


def tiny_moe(model_type: str):
    """A ``TINY`` mixture-of-experts config with ``EXPERTS``: ``qwen3_moe`` (q/k norms, head_dim 16, top-k weights
    renormalised), ``qwen2_moe`` (a shared expert of width 48) or ``mixtral`` (its experts' width is
    ``intermediate_size``)."""
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    if model_type == "qwen3_moe":
        return Qwen3MoeConfig(**TINY, **EXPERTS, head_dim=16, norm_topk_prob=True)
    if model_type == "qwen2_moe":
        return Qwen2MoeConfig(**TINY, **EXPERTS, shared_expert_intermediate_size=48)
    width, top_k = EXPERTS["moe_intermediate_size"], EXPERTS["num_experts_per_tok"]
    return MixtralConfig(**{**TINY, "intermediate_size": width}, num_local_experts=4, num_experts_per_tok=top_k)
