"""Exact attention-head padding: run a model whose KV groups do not divide ``tp_size`` under Megatron TP.

For example SmolLM2-135M (9 heads, 3 KV groups) at ``tp_size=2``.

Megatron needs ``num_attention_heads % tp_size == 0`` and ``num_query_groups % tp_size == 0``. With
``pad_attention_heads=True`` the Megatron model gets ``G_pad`` KV groups, ``G`` rounded up to a multiple of
``tp_size``, each with the HF number of query heads per group ``Q/G`` (SmolLM2 at TP=2: 3 groups x 3 heads ->
4 groups x 3 heads = 12 heads). ``kv_channels`` stays the HF head_dim ``D``, so the attention width
``Q_pad * D`` (768) may differ from the hidden size (576); Megatron allows that. The ``G_pad - G`` padded groups
come *after* the HF groups (global group indices ``G .. G_pad-1``, so the last TP ranks hold them) and are:

* zero rows in ``linear_qkv`` (their query heads, key and value; zero biases for qkv-bias models);
* zero columns in ``linear_proj`` (the HF ``o_proj`` input columns of their query heads).

Why this is exact, for the forward pass and for training (Adam or AdamW, with gradient clipping):

1. Forward. A padded head has ``v = x W_v + b_v = 0``, so its attention output ``softmax(q k^T / sqrt(D)) v`` is
   0 whatever the (finite, uniform) attention probabilities are; its ``o_proj`` columns are 0 as well. The
   output projection therefore receives exactly the HF heads' contributions: same function as the HF model
   (up to fp summation order, as with any TP split).
2. Gradients. ``d loss / d W_o[:, padded]`` = ``attention_output_padded^T @ d out`` = 0 (the input is 0).
   ``d loss / d attention_output_padded`` = ``d out @ W_o[:, padded]`` = 0 (the columns are 0), so nothing flows
   back into the padded head's q, k or v: their ``linear_qkv`` rows and biases get exactly 0, and the padded
   head adds exactly 0 to the gradient of the layer input and of shared weights (Qwen3's q/k norms). The
   gradients of all real weights are those of the unpadded model, and so is the global gradient norm.
3. Updates. Adam with an exactly-zero gradient keeps ``m = v = 0`` and applies ``lr * m_hat / (sqrt(v_hat) + eps)
   = 0``; decoupled weight decay subtracts ``lr * wd * 0 = 0``; clipping scales 0 to 0; bf16 casts of an fp32 0
   are 0. By induction over steps the padded weights stay exactly 0 forever and points 1-2 hold at every step.

Export and weight streaming (``hf_conversion.hf_from_shards``, hence ``hf_stream.iter_hf_weights`` and
``MegatronPolicy.export_hf``) drop the padded groups, so vLLM and ``transformers`` see the original HF names,
shapes and config. Checkpoints (``checkpoint.py``) save the *padded* Megatron layout: resume with the same
``pad_attention_heads`` and a ``tp_size`` that gives the same ``G_pad`` (e.g. SmolLM2: TP=2 or TP=4 -> 4 groups;
TP=1 and TP=3 need no padding and save 3 groups), or start again from an exported HF folder.

Cost: ``(G_pad - G) / G`` extra attention FLOPs and ``linear_qkv``/``linear_proj`` memory (SmolLM2 at TP=2: 1/3
more attention projection weights, 8.8M on top of 135M parameters), spent on the TP ranks holding padded groups.
"""

from __future__ import annotations

import math


def valid_tp_sizes(num_query_groups: int) -> list[int]:
    """TP sizes that split ``num_query_groups`` KV groups (and therefore their heads) evenly without padding."""
    return [size for size in range(1, num_query_groups + 1) if num_query_groups % size == 0]


def padded_num_query_groups(
    *,
    num_heads: int,
    num_query_groups: int,
    tp_size: int,
    pad_attention_heads: bool,
    padding_tp_size: int | None = None,
) -> int:
    """Number of KV groups ``G_pad`` of the Megatron model for an HF model with ``Q`` heads and ``G`` groups.

    Args:
        num_heads: HF ``num_attention_heads`` ``Q``.
        num_query_groups: HF ``num_key_value_heads`` ``G`` (``Q`` for multi-head attention).
        tp_size: tensor-parallel size.
        pad_attention_heads: allow padding ``G`` up to the next multiple of ``tp_size`` (see module docstring).
        padding_tp_size: with ``pad_attention_heads``, pad to a multiple of ``lcm(tp_size, padding_tp_size)``
            instead, i.e. the layout a run at ``padding_tp_size`` saved (to load its checkpoint at another TP).

    Returns:
        ``G`` when ``Q`` and ``G`` are divisible by ``tp_size``, otherwise (padding allowed) the smallest multiple
        of ``tp_size`` that is ``>= G``. The Megatron model has ``G_pad * Q / G`` attention heads.

    Raises:
        ValueError: ``Q`` is not a multiple of ``G``, or padding is needed and ``pad_attention_heads`` is False.
    """
    if num_query_groups < 1 or num_heads % num_query_groups:
        raise ValueError(
            f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads="
            f"{num_query_groups}; grouped-query attention needs equal groups"
        )
    multiple = math.lcm(tp_size, padding_tp_size or tp_size) if pad_attention_heads else tp_size
    if num_query_groups % multiple == 0:  # then num_heads, a multiple of num_query_groups, divides too
        return num_query_groups
    padded = -(-num_query_groups // multiple) * multiple
    if pad_attention_heads:
        return padded
    raise ValueError(
        f"num_attention_heads={num_heads} and num_key_value_heads={num_query_groups} must both be divisible by "
        f"tp_size={tp_size}; set model.pad_attention_heads=true to pad the model exactly with zero heads to "
        f"{padded} KV groups ({padded * (num_heads // num_query_groups)} heads), or use a tp_size in "
        f"{valid_tp_sizes(num_query_groups)}"
    )
