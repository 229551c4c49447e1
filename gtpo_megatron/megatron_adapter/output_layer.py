"""fp32 output layer: vocab-parallel logits computed in fp32 from 16-bit parameters (``model.fp32_output_layer``).

bf16 logits are off by up to a few 1e-3 nats in the log-probs, which feed the ratio, the mismatch metrics and the
entropy filter; fp32 logits are within about 1e-6 (``benchmarks/bench_fp32_output_layer.py``). The matmul runs
on fp32 casts of the 16-bit input and weight through Megatron's own linear function, so the TP communication is
unchanged; no fp32 weight copy is kept, and a saved-tensor hook stores the 16-bit originals for backward. Why,
and the memory cost: docs/models.md. Not compatible with ``gradient_accumulation_fusion``.
"""

from __future__ import annotations

import functools

import torch


def _fp32_linear(linear_impl, input: torch.Tensor, weight: torch.Tensor, *args, **kwargs):  # noqa: A002
    """``linear_impl`` on fp32 casts of ``input`` and ``weight``; saved tensors stay 16-bit, re-cast on use."""
    casts = {}  # id of an fp32 cast -> its 16-bit original; only this call's casts are replaced

    def cast(tensor: torch.Tensor) -> torch.Tensor:
        upcast = tensor.float()
        if upcast is not tensor:
            casts[id(upcast)] = tensor
        return upcast

    def pack(saved: torch.Tensor):
        original = casts.get(id(saved))
        return saved if original is None else (original,)

    def unpack(packed):
        return packed[0].float() if isinstance(packed, tuple) else packed

    input32, weight32 = cast(input), cast(weight)
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return linear_impl(input32, weight32, *args, **kwargs)


@functools.cache
def _fp32_output_class(layer_cls: type) -> type:
    """``layer_cls`` whose ``_forward_impl`` (Megatron's matmul + TP communication) runs through ``_fp32_linear``."""

    def _forward_impl(self, input, weight, *args, **kwargs):  # noqa: A002 (Megatron passes input= by keyword)
        return _fp32_linear(super(fp32_cls, self)._forward_impl, input, weight, *args, **kwargs)

    doc = f"{layer_cls.__name__} computing its output in fp32 (megatron_adapter.output_layer)."
    fp32_cls = type(
        f"Fp32{layer_cls.__name__}",
        (layer_cls,),
        {"_forward_impl": _forward_impl, "__doc__": doc, "computes_in_fp32": True},
    )
    return fp32_cls


def use_fp32_output_layer(output_layer) -> None:
    """Switch a GPTModel's ``output_layer`` to fp32 logits ``[s, b, V/tp]`` in place; idempotent, no-op in fp32.

    Collectives: none added; the layer's TP collectives run on fp32 tensors (twice the bytes).

    Raises:
        ValueError: the layer's config has ``gradient_accumulation_fusion`` on.
    """
    if output_layer.config.gradient_accumulation_fusion:
        raise ValueError(
            "fp32_output_layer=True cannot be combined with gradient_accumulation_fusion=True (the "
            "fused kernel accumulates into weight.main_grad, which the fp32 cast lacks); turn one off"
        )
    if not getattr(output_layer, "computes_in_fp32", False):
        output_layer.__class__ = _fp32_output_class(type(output_layer))
