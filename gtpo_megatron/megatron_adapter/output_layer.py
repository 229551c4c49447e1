"""fp32 output layer: vocab-parallel logits computed in fp32 from 16-bit parameters (``model.fp32_output_layer``).

With bf16 parameters Megatron's output layer (a ``ColumnParallelLinear`` with vocab-parallel ``[s, b, V/tp]``
output) multiplies bf16 hidden states by the bf16 weight and rounds the logits to bf16 (8 significant bits) before
the fp32 log-softmax of ``ops.vocab_parallel_logprobs_entropy``: on a random tied tiny Llama (hidden 64, vocabulary
1000) the log-probs are then up to a few 1e-3 nats from a float64 computation on the same bf16 weights and hidden
states; with ``use_fp32_output_layer`` they are within about 1e-6 (``benchmarks/bench_fp32_output_layer.py``).
Those log-probs feed the policy ratio, the train/rollout mismatch and the entropy the GTPO filter reads.

How: the layer's matmul runs on fp32 casts of its 16-bit input and weight, through Megatron's own linear function
(``ColumnParallelLinear._forward_impl``, overridden in an fp32 subclass the layer is switched to), so its
tensor-parallel communication (the input-gradient all-reduce, or the sequence-parallel gather / reduce-scatter) is
unchanged, only in fp32. Choices:

* Upcast on the fly, no fp32 copy of the weight: a copy would cost ``V/tp * h * 4`` bytes for good, go stale at
  every optimizer step (the distributed optimizer's fp32 main weights are sharded over data-parallel ranks, so
  they cannot stand in) and, with tied embeddings, split the one shared weight in two. The cast keeps the single
  (possibly tied) 16-bit parameter as the only state; its gradient flows back through the cast, rounded to the
  parameter dtype like every other parameter gradient, and Megatron's DDP adds it to the fp32 main-grad buffer
  (a tied weight still gets the sum of its embedding and output uses).
* Autograd would keep the fp32 casts of the weight and of the hidden states alive until backward; a saved-tensor
  hook stores the 16-bit originals instead and re-casts them when backward needs them, so the fp32 weight copy
  exists only while a matmul uses it.

Cost, one micro-batch of ``n = b*s`` tokens on the last pipeline stage: the logits and their gradient are fp32
(``2 * 4 * n * V/tp`` bytes instead of ``2 * 2 * n * V/tp``), plus transient fp32 ``[V/tp, h]`` tensors (the
weight cast, and Megatron's fp32 weight gradient before its cast back) during the layer's forward and backward.
The log-prob op needs no extra memory (it already computes in fp32; with fp32 logits its backward writes the
gradient in place). Not compatible with ``gradient_accumulation_fusion`` (it writes the weight gradient into
``weight.main_grad``, which the cast does not have).
"""

from __future__ import annotations

import functools

import torch


def _fp32_linear(linear_impl, input: torch.Tensor, weight: torch.Tensor, *args, **kwargs):  # noqa: A002
    """``linear_impl`` (Megatron's linear autograd function) on fp32 casts of ``input`` and ``weight``; fp32 out.

    Megatron passes both by keyword; the tensors it saves for backward are stored as the 16-bit originals and
    re-cast on use.
    """
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
    """Make a GPTModel's ``output_layer`` compute its logits in fp32 (see the module docstring), in place.

    Args:
        output_layer: Megatron ``ColumnParallelLinear`` (``GPTModel.output_layer``), any parameter dtype; a no-op
            for fp32 parameters. Its own weight or the tied embedding weight GPTModel passes at call time are
            both handled. Its class becomes an fp32 subclass (parameters, names and state dict unchanged); calling
            it twice changes nothing.

    Returns:
        None. Afterwards the layer returns fp32 logits ``[s, b, V/tp]`` (``GPTModel`` hands them on as
        ``[b, s, V/tp]``); the input and weight gradients keep their 16-bit dtypes.

    Collectives: none added; the layer's own TP collectives run on fp32 tensors (twice the bytes).

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
