"""The local layer spec's core attention through ``torch.nn.functional.scaled_dot_product_attention``.

Megatron-core's ``DotProductAttention`` (the core attention of ``get_gpt_layer_local_spec``) forms the
``[b, heads, s, s]`` scores with ``baddbmm``, a masked softmax and a ``bmm``, and keeps the probabilities for the
backward. :class:`SDPAttention` computes the same ``softmax(q k^T * softmax_scale) v`` with torch's fused kernels
(flash attention on the CPU and on CUDA), which keep no score matrix, and is what Hugging Face models run.

It takes over only where the two are the same function: no sliding window, Megatron's vanilla softmax, no attention
dropout, no attention bias and no ``packed_seq_params``; anything else runs Megatron's forward unchanged. Masks follow
Megatron's convention (bool, True = masked, broadcast over ``[b, heads, s, s]``): None is the causal mask of the
spec's ``attn_mask_type`` (``model.causal_attention_mask`` passes None for unpacked rows), a packed row's
block-diagonal mask is given to SDPA inverted. Equality: ``tests/adapter/test_sdpa_attention.py``.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def sdpa_attention_class() -> type:
    """``SDPAttention``, a ``DotProductAttention`` subclass defined on first use (this module imports no megatron)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    class SDPAttention(DotProductAttention):
        """``DotProductAttention`` whose forward is one SDPA call where that is the same function (module docstring)."""

        def __init__(self, *args, **kwargs) -> None:  # noqa: D107 (Megatron's arguments)
            super().__init__(*args, **kwargs)
            self.fused = (
                self.scale_mask_softmax.window_size is None
                and self.softmax_offset is None
                and self.attention_dropout.p == 0.0
                and not self.config.apply_query_key_layer_scaling
            )

        def forward(
            self,
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            attention_mask: torch.Tensor | None,
            attn_mask_type: AttnMaskType | None = None,
            attention_bias: torch.Tensor | None = None,
            packed_seq_params=None,
        ) -> torch.Tensor:
            """``[sq, b, heads * d]`` context of ``query`` ``[sq, b, heads, d]``.

            ``key``/``value`` ``[sk, b, groups, d]``; in the input dtype (fp32 accumulation inside the kernel).
            """
            if not self.fused or attention_bias is not None or packed_seq_params is not None:
                return super().forward(
                    query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params
                )
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            repeats = q.shape[1] // k.shape[1]
            if repeats > 1:
                k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
            causal = attention_mask is None and self.attn_mask_type == AttnMaskType.causal and q.shape[2] > 1
            context = torch.nn.functional.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=None if attention_mask is None else ~attention_mask,
                is_causal=causal,
                scale=self.softmax_scale,
            )
            return context.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)

    return SDPAttention
