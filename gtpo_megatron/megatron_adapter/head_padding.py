"""Exact attention-head padding: run a model whose KV groups do not divide ``tp_size`` under Megatron TP.

With ``pad_attention_heads`` the Megatron model gets ``G_pad`` KV groups (``G`` rounded up to a multiple of
``tp_size``, each with the HF ``Q/G`` query heads; e.g. SmolLM2-135M at TP=2: 3 -> 4 groups). The padded groups
come after the HF ones, as zero rows of ``linear_qkv`` and zero columns of ``linear_proj``: their value vectors and
output columns are 0, so forward, gradients and Adam updates of the real weights are those of the unpadded model
and the padded weights stay exactly 0 (the derivation is in docs/models.md). Exports and weight streams drop the
padding; checkpoints keep the padded layout.
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
    """``G_pad``: ``G`` if ``Q`` and ``G`` divide by ``tp_size``, else the next multiple of ``tp_size``.

    With ``padding_tp_size``, of ``lcm(tp_size, padding_tp_size)``: the layout a run at that TP size saved.

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


def resume_padding_error(
    checkpoint: str, *, saved_tp_size: int, tp_size: int, num_heads: int, num_query_groups: int, padded_groups: int
) -> ValueError | None:
    """Why ``checkpoint`` (written at ``saved_tp_size``) cannot load into ``padded_groups`` KV groups at ``tp_size``.

    None when it holds as many (checkpoints keep the padded layout).
    """
    saved = padded_num_query_groups(
        num_heads=num_heads, num_query_groups=num_query_groups, tp_size=saved_tp_size, pad_attention_heads=True
    )  # a run that needed no padding saved G groups, which this returns then
    if saved == padded_groups:
        return None
    per_group = num_heads // num_query_groups
    return ValueError(
        f"checkpoint {checkpoint!r} was written at parallel.tp_size={saved_tp_size}, whose attention heads are padded "
        f"to {saved} KV groups ({saved * per_group} heads); at parallel.tp_size={tp_size} this model has "
        f"{padded_groups} ({padded_groups * per_group} heads), and checkpoints keep the padded layout "
        f"(model.pad_attention_heads, docs/models.md); resume with parallel.tp_size={saved_tp_size}, or export the "
        f"checkpoint to Hugging Face (`python -m gtpo_megatron.evaluation.checkpoint_export {checkpoint}` drops the "
        f"padding) and start a new run with model.name_or_path={checkpoint}/hf"
    )
