"""The policy loss in Megatron's two ``loss_func`` conventions, for a caller's own forward step (``plugin``'s loss).

Megatron's schedule (``forward_step_calc_loss``) calls ``loss_func(output_tensor)`` on the last pipeline stage of
each of the ``M`` micro-batches and accepts two return forms. Let ``S_dm`` be the un-normalised loss sum of
micro-batch ``m`` on data-parallel rank ``d`` (``ops`` loss with normaliser 1) and ``c_dm`` its local count
(``ops.compute_normalizer`` of its rows for ``spec.aggregation``: response tokens for ``token-mean``, sequences
with a response token for the ``seq-mean`` modes, times L for Dr. GRPO), so the step objective is
``J = sum S_dm / N`` with ``N = sum c_dm`` (``ops/losses.py``).

* **Per-token form** ``(S_dm, c_dm, metrics)`` (:func:`per_token_loss`). With ``calculate_per_token_loss=True``
  the schedule sums the returned counts, DDP sums the gradients over the ``D`` ranks (scaling factor 1) and
  ``finalize_model_grads`` divides every gradient by the all-reduced total ``sum c_dm = N``: the optimizer sees
  ``grad J`` exactly, with no normaliser computed beforehand. With ``calculate_per_token_loss=False`` Megatron
  divides by ``c_dm`` and by ``M`` and DDP averages over ``D``: a per-micro-batch mean, averaged (Megatron-LM's own
  GRPO under that setting).
* **Legacy form** ``(S_dm / N * M * D, metrics)`` (:func:`legacy_loss`), ``calculate_per_token_loss=False``: the
  schedule divides by ``M`` and DDP averages over ``D`` (``forward_step``'s module docstring derives it), so the
  gradient is again ``grad J``; ``N`` (``settings.normalizer``) must be the step's global normaliser, computed
  before the schedule runs (``parallel.global_normalizer``), and ``settings.loss_scale = M * D``
  (:func:`loss_settings`).

Inputs: the log-probs come either from vocab-parallel logits ``[b, S, V/tp]`` (``parallel_output=True``) through
``forward_step.token_logprobs_entropy`` (the fused op on ``settings.tp_group``, vocabulary never gathered), or
from the caller (``*_from_logprobs``). Per-token tensors use the ``TrainBatch`` column convention (column ``s``
describes token ``s``; column 0 is never a response token). A packed row (``[1, N]`` holding several sequences,
``ops.PackedLayout``) is unpacked to one sequence per row before the loss, so it gives the padded result exactly.

Metrics: ``{"gtpo/<name>": fp32 tensor([numerator, denominator])}``, detached, Megatron-LM's reporting convention
(its ``train_step`` sums every 2-element value over micro-batches and data-parallel ranks, then divides), in both
forms: ``gtpo/loss`` (``S / c``: the objective ``J``), ``gtpo/clip_frac``, ``gtpo/ratio_mean``,
``gtpo/entropy_mean`` (with entropy), ``gtpo/kl_mean``, ``gtpo/amplified_frac`` (weight > 1) and
``gtpo/zero_weight_frac`` (weight 0), the last five over response tokens. :func:`reduce_loss_metrics` does the
same reduction for custom loops.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import torch

from gtpo_megatron.megatron_adapter.forward_step import (
    LossSettings,
    MicroBatch,
    forward_step,
    policy_loss,
    token_logprobs_entropy,
)
from gtpo_megatron.ops import LossSpec, PackedLayout, compute_normalizer
from gtpo_megatron.parallel.collectives import reduce_metric_sums

_REPORTED = {  # reported name: (numerator, denominator) among the ops metric sums
    "clip_frac": ("clipped_tokens", "num_tokens"),
    "ratio_mean": ("ratio_sum", "num_tokens"),
    "entropy_mean": ("entropy_sum", "num_tokens"),
    "kl_mean": ("kl_sum", "num_tokens"),
    "amplified_frac": ("amplified_tokens", "num_tokens"),
    "zero_weight_frac": ("zero_weight_tokens", "num_tokens"),
}


def loss_settings(
    spec: LossSpec,
    *,
    vocab_size: int,
    tp_group=None,
    chunk_size: int | None = None,
    normalizer: torch.Tensor | None = None,
    num_microbatches: int = 1,
    dp_size: int = 1,
) -> LossSettings:
    """The loss settings of one optimizer step.

    Args:
        spec: the step objective (``algorithm.build_loss_spec`` or a ``LossSpec``); its temperature is the
            log-prob temperature.
        vocab_size: the tokenizer's vocabulary size; logit columns ``>= vocab_size`` (Megatron's padding) are
            excluded from every softmax.
        tp_group: the tensor-parallel group sharding the logits' vocabulary; None: the logits hold every column.
        chunk_size: tokens per chunk of the fused log-prob op (None: one chunk).
        normalizer: legacy form only: the step's global normaliser ``N`` (fp32 scalar).
        num_microbatches: legacy form only: ``M``, the micro-batches of the step on this rank.
        dp_size: legacy form only: ``D``, the data-parallel size (``loss_scale = M * D``).

    Raises:
        ValueError: ``num_microbatches`` or ``dp_size`` < 1.
    """
    if num_microbatches < 1 or dp_size < 1:
        raise ValueError(f"num_microbatches={num_microbatches} and dp_size={dp_size} must both be >= 1")
    return LossSettings(
        tp_group=tp_group,
        vocab_size=vocab_size,
        temperature=spec.temperature,
        chunk_size=chunk_size,
        loss=spec,
        normalizer=normalizer,
        loss_scale=float(num_microbatches * dp_size),
    )


def per_token_loss(logits: torch.Tensor, batch: MicroBatch, settings: LossSettings, packed: PackedLayout | None = None):
    """Per-token form ``(loss_sum, count, metrics)`` from vocab-parallel logits ``[b, S, V/tp]`` (module docstring).

    Collectives: two all-reduces on ``settings.tp_group`` (the fused op).
    """
    logprobs, entropy = token_logprobs_entropy(logits, batch, settings)
    return per_token_loss_from_logprobs(logprobs, batch, settings, entropy=entropy, packed=packed)


def legacy_loss(logits: torch.Tensor, batch: MicroBatch, settings: LossSettings, packed: PackedLayout | None = None):
    """Legacy form ``(loss, metrics)`` from vocab-parallel logits ``[b, S, V/tp]`` (module docstring).

    Collectives: two all-reduces on ``settings.tp_group`` (the fused op).
    """
    logprobs, entropy = token_logprobs_entropy(logits, batch, settings)
    return legacy_loss_from_logprobs(logprobs, batch, settings, entropy=entropy, packed=packed)


def per_token_loss_from_logprobs(
    logprobs: torch.Tensor,
    batch: MicroBatch,
    settings: LossSettings,
    *,
    entropy: torch.Tensor | None = None,
    packed: PackedLayout | None = None,
):
    """Per-token form from the caller's log-probs ``[b, S]`` (``[1, N]`` packed): ``(S, count, metrics)``.

    ``S`` is an fp32 scalar differentiable w.r.t. ``logprobs``; ``count`` an int32 scalar. No collectives.
    """
    loss_sum, count, metrics = _summed(logprobs, entropy, batch, settings, packed)
    return loss_sum, count.to(torch.int), metrics


def legacy_loss_from_logprobs(
    logprobs: torch.Tensor,
    batch: MicroBatch,
    settings: LossSettings,
    *,
    entropy: torch.Tensor | None = None,
    packed: PackedLayout | None = None,
):
    """Legacy form from the caller's log-probs: ``(S / N * loss_scale, metrics)``. No collectives.

    Raises:
        ValueError: ``settings.normalizer`` is None (the legacy form needs the step's global normaliser).
    """
    if settings.normalizer is None:
        raise ValueError(
            "the legacy (2-tuple) loss needs settings.normalizer, the step's global normaliser N "
            "(parallel.global_normalizer over every micro-batch and data-parallel rank); or use the per-token form"
        )
    loss_sum, _, metrics = _summed(logprobs, entropy, batch, settings, packed)
    return loss_sum / settings.normalizer * settings.loss_scale, metrics


def _summed(logprobs, entropy, batch: MicroBatch, settings: LossSettings, packed: PackedLayout | None):
    """``(S, count, reported metrics)`` of one micro-batch (one packed row unpacked first)."""
    spec = settings.loss
    if spec is None:
        raise ValueError("settings.loss is None; build the settings with loss_settings(spec, ...)")
    if packed is not None:
        logprobs = packed.unpack(logprobs)
        entropy = None if entropy is None else packed.unpack(entropy)
        batch = _unpacked(batch, packed)
    one = torch.ones((), dtype=torch.float32, device=logprobs.device)
    loss_sum, sums = policy_loss(logprobs, entropy, batch, spec, one)
    count = compute_normalizer(batch.response_mask, spec.aggregation, max_response_length=spec.max_response_length)
    return loss_sum, count, _report(loss_sum.detach(), count, sums)


def _unpacked(batch: MicroBatch, packed: PackedLayout) -> MicroBatch:
    """The micro-batch's per-token tensors laid out one sequence per row (advantages are already per sequence)."""

    def unpack(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else packed.unpack(t)

    fields = ("input_ids", "position_ids", "response_mask", "token_weights", "old_logprobs", "ref_logprobs")
    return dataclasses.replace(batch, attention_mask=None, **{k: unpack(getattr(batch, k)) for k in fields})


def _report(loss_sum: torch.Tensor, count: torch.Tensor, sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    pairs = {"loss": (loss_sum, count)}
    pairs.update({name: (sums[num], sums[den]) for name, (num, den) in _REPORTED.items() if num in sums})
    return {f"gtpo/{name}": torch.stack([num.float(), den.float()]) for name, (num, den) in pairs.items()}


def reduce_loss_metrics(store: list[dict[str, torch.Tensor]], *, group) -> dict[str, float]:
    """``{name: numerator / denominator}`` of the reported pairs, summed over micro-batches and ``group``.

    Args:
        store: the schedule's return value on the last pipeline stage (one dict per micro-batch).
        group: the data-parallel group (None: this process is the only replica).

    Returns:
        Plain floats (0 where a denominator is 0), identical on every rank of ``group``.

    Collectives: one SUM all-reduce on ``group`` (``parallel.reduce_metric_sums``).
    """
    if not store:
        return {}
    totals = {name: torch.stack([d[name] for d in store]).sum(dim=0) for name in store[0]}
    flat = {f"{name}\0{i}": total[i] for name, total in totals.items() for i in (0, 1)}
    summed = reduce_metric_sums(flat, group=group)
    return {name: float(summed[f"{name}\0{0}"] / summed[f"{name}\0{1}"].clamp(min=1e-30)) for name in totals}


def make_forward_step(settings: LossSettings, *, per_token: bool = True):
    """Megatron ``forward_step_func(data_iterator, model)`` for a caller's ``GPTModel`` (any layer spec).

    Each call takes the next ``MicroBatch`` from the iterator, runs ``model(input_ids, position_ids,
    attention_mask)`` (the model must be built with ``parallel_output=True``: ``[b, S, V/tp]`` logits) and returns
    the output with the bound :func:`per_token_loss` (or :func:`legacy_loss`).
    """
    loss_fn = per_token_loss if per_token else legacy_loss
    return partial(_checked_forward_step, settings=settings, loss_fn=loss_fn)


def _checked_forward_step(data_iterator, model, *, settings: LossSettings, loss_fn):
    inner = model
    while not hasattr(inner, "parallel_output") and hasattr(inner, "module"):
        inner = inner.module  # DDP / Float16Module wrappers
    if getattr(inner, "parallel_output", True) is False and settings.tp_group is not None:
        raise ValueError(
            "the model was built with parallel_output=False, so its logits hold the gathered vocabulary; build the "
            "GPTModel with parallel_output=True (the fused op reads the [b, S, V/tp] shard on settings.tp_group)"
        )
    return forward_step(data_iterator, model, settings=settings, loss_fn=loss_fn)
