"""``SDPAttention`` (the local spec's core attention) against a float64 hand-written softmax attention.

The reference is ``softmax(q k^T * scale + mask) v`` with each KV group repeated over its query heads, written out
in float64; both the causal case (mask None, the spec's causal type) and a packed row's block-diagonal mask, values
and the gradients of q, k, v. A module that cannot use SDPA (a sliding window) must say so and keep Megatron's path.
"""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402

from gtpo_megatron.megatron_adapter.sdpa_attention import sdpa_attention_class  # noqa: E402

HEADS, GROUPS, HEAD_DIM, SEQ, ROWS = 6, 2, 8, 9, 2


def _attention(**config_fields) -> torch.nn.Module:
    config = TransformerConfig(
        num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, num_query_groups=GROUPS,
        kv_channels=HEAD_DIM, attention_dropout=0.0, use_cpu_initialization=True, **config_fields,
    )  # fmt: skip
    tp = types.SimpleNamespace(tp=types.SimpleNamespace(size=lambda: 1))
    return sdpa_attention_class()(config, 1, AttnMaskType.causal, "self", pg_collection=tp)


def _qkv():
    gen = torch.Generator().manual_seed(0)
    shapes = [(SEQ, ROWS, HEADS, HEAD_DIM), (SEQ, ROWS, GROUPS, HEAD_DIM), (SEQ, ROWS, GROUPS, HEAD_DIM)]
    return [torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True) for shape in shapes]


def _reference(q, k, v, masked: torch.Tensor) -> torch.Tensor:
    """``[S, B, H * D]`` float64 attention; ``masked`` ``[S, S]`` True = not attended."""
    k, v = (t.repeat_interleave(HEADS // GROUPS, dim=2) for t in (k, v))
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) / HEAD_DIM**0.5
    probs = torch.softmax(scores.masked_fill(masked, float("-inf")), dim=-1)
    return torch.einsum("bhst,tbhd->sbhd", probs, v).reshape(SEQ, ROWS, HEADS * HEAD_DIM)


def _causal() -> torch.Tensor:
    return torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)


def _packed() -> torch.Tensor:
    segments = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2, 2])
    return _causal() | (segments[:, None] != segments[None, :])


@pytest.mark.parametrize("case", ["causal", "packed"])
def test_matches_float64_reference_values_and_gradients(case):
    attention = _attention()
    assert attention.fused
    masked = _causal() if case == "causal" else _packed()
    q, k, v = _qkv()
    out = attention(q, k, v, None if case == "causal" else masked[None, None])
    ref_inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref = _reference(*ref_inputs, masked)
    assert out.shape == ref.shape and out.dtype == torch.float64
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    upstream = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads = torch.autograd.grad(out, (q, k, v), upstream)
    ref_grads = torch.autograd.grad(ref, ref_inputs, upstream)
    for grad, ref_grad in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref_grad, atol=1e-12, rtol=0)


def test_packed_mask_keeps_sequences_apart():
    """Changing a later segment's keys and values leaves an earlier segment's outputs unchanged."""
    attention = _attention()
    q, k, v = _qkv()
    mask = _packed()[None, None]
    before = attention(q, k, v, mask).detach()
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[4:], v2[4:] = 0.0, 0.0
    after = attention(q.detach(), k2, v2, mask)
    torch.testing.assert_close(after[:4], before[:4], atol=0, rtol=0)
    assert not torch.allclose(after[4:], before[4:])


def test_sliding_window_keeps_megatrons_path():
    assert not _attention(window_size=(4, 0)).fused
