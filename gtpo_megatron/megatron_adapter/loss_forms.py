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

from gtpo_megatron.megatron_adapter.external_model import unwrap_model
from gtpo_megatron.megatron_adapter.forward_step import (
    LossSettings,
    MicroBatch,
    forward_step,
    policy_loss,
    token_logprobs_entropy,
)
from gtpo_megatron.ops import LossSpec, PackedLayout, compute_normalizer
from gtpo_megatron.parallel.collectives import all_reduce_sum

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
    """Per-token form ``(loss_sum, count, metrics)`` of one micro-batch from its vocab-parallel logits.

    Args:
        logits: ``[b, S, V/tp]`` this TP rank's vocabulary shard (``parallel_output=True``), any float dtype;
            ``[1, N, V/tp]`` for a packed row. Position ``s`` predicts token ``s + 1``. Not modified.
        batch: the micro-batch, per-token tensors ``[b, S]`` (``[1, N]`` packed) in the ``TrainBatch`` column
            convention: ``input_ids`` (int64, the targets), ``response_mask`` (bool, True on response tokens),
            ``token_weights`` (fp32 lambda * delta; None = 1 on every response token), ``old_logprobs`` (nats; None =
            one update per batch, ratio 1 with gradient), ``ref_logprobs`` (nats, for ``spec.kl_coef > 0``);
            ``advantages`` ``[b]`` (``[n]`` packed) fp32.
        settings: from :func:`loss_settings` (``settings.loss`` is the objective).
        packed: the packed row's layout, or None for one sequence per row.

    Returns:
        ``(loss_sum, count, metrics)``: ``loss_sum`` fp32 scalar ``S`` (un-normalised, differentiable w.r.t.
        ``logits``; the log-prob computation runs in fp32), ``count`` int32 scalar (the micro-batch's normaliser
        count for ``spec.aggregation``), ``metrics`` the detached ``[numerator, denominator]`` pairs of the module
        docstring.

    Collectives: two all-reduces on ``settings.tp_group`` in forward (the fused log-prob/entropy op).

    Raises:
        ValueError: ``settings.loss`` is None, shape/dtype mismatches, target ids outside ``[0, vocab_size)``, a
            logits width inconsistent with the TP group, a bad ``packed`` layout, or what the registered loss
            refuses (e.g. ``kl_coef > 0`` for ``gtpo``, or without ``ref_logprobs``).
    """
    logprobs, entropy = token_logprobs_entropy(logits, batch, settings)
    return per_token_loss_from_logprobs(logprobs, batch, settings, entropy=entropy, packed=packed)


def legacy_loss(logits: torch.Tensor, batch: MicroBatch, settings: LossSettings, packed: PackedLayout | None = None):
    """Legacy form ``(loss, metrics)`` of one micro-batch from its vocab-parallel logits.

    Args:
        logits: as :func:`per_token_loss`.
        batch: as :func:`per_token_loss`.
        settings: from :func:`loss_settings` with ``normalizer`` (the step's global ``N``), ``num_microbatches``
            and ``dp_size``.
        packed: as :func:`per_token_loss`.

    Returns:
        ``(S / N * M * D, metrics)``: fp32 scalar differentiable w.r.t. ``logits``, and the metric pairs.

    Collectives: two all-reduces on ``settings.tp_group`` in forward (the fused log-prob/entropy op).

    Raises:
        ValueError: ``settings.normalizer`` is None, and the errors of :func:`per_token_loss`.
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
    """:func:`per_token_loss` from log-probs the caller already has.

    Args:
        logprobs: ``[b, S]`` (``[1, N]`` packed) fp32 log pi_theta in nats, ``TrainBatch`` columns (a Megatron-LM
            ``[b, S-1]`` tensor becomes this with ``F.pad(x, (1, 0))``), differentiable; off-response values are
            ignored.
        batch: as :func:`per_token_loss` (``input_ids`` is not read).
        settings: from :func:`loss_settings` (only ``settings.loss`` is read).
        entropy: optional ``[b, S]`` detached token entropy in nats, for the ``gtpo/entropy_mean`` metric.
        packed: as :func:`per_token_loss`.

    Returns:
        ``(loss_sum, count, metrics)`` as :func:`per_token_loss`, differentiable w.r.t. ``logprobs``.

    Collectives: none.

    Raises:
        ValueError: the errors of :func:`per_token_loss` that concern the loss.
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
    """:func:`legacy_loss` from log-probs the caller already has.

    Args:
        logprobs: as :func:`per_token_loss_from_logprobs`.
        batch: as :func:`per_token_loss`.
        settings: as :func:`legacy_loss`.
        entropy: as :func:`per_token_loss_from_logprobs`.
        packed: as :func:`per_token_loss`.

    Returns:
        ``(S / N * M * D, metrics)`` as :func:`legacy_loss`, differentiable w.r.t. ``logprobs``.

    Collectives: none.

    Raises:
        ValueError: ``settings.normalizer`` is None (the legacy form needs the step's global normaliser), and the
            errors of :func:`per_token_loss_from_logprobs`.
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

    Collectives: one SUM all-reduce of a ``[K, 2]`` tensor on ``group`` (``parallel.all_reduce_sum``).
    """
    if not store:
        return {}
    names = sorted(store[0])
    totals = torch.stack([torch.stack([d[name] for d in store]).sum(dim=0) for name in names])  # [K, 2]
    totals = all_reduce_sum(totals, group=group)
    ratios = torch.where(totals[:, 1] > 0, totals[:, 0] / totals[:, 1].clamp(min=1e-30), 0.0)
    return dict(zip(names, ratios.tolist()))


def make_forward_step(settings: LossSettings, *, per_token: bool = True):
    """Megatron's ``forward_step_func(data_iterator, model)`` for a caller's ``GPTModel`` (any layer spec).

    Each call takes the next ``MicroBatch`` from the iterator, runs ``model(input_ids, position_ids,
    attention_mask)`` and returns the output with the bound loss (``forward_step.forward_step``).

    Args:
        settings: from :func:`loss_settings` (with ``normalizer`` for the legacy form).
        per_token: bind :func:`per_token_loss` (for ``calculate_per_token_loss=True``), else :func:`legacy_loss`.

    Returns:
        The function to pass as ``get_forward_backward_func()(forward_step_func=...)``. When called it raises
        ValueError for a model built with ``parallel_output=False`` under tensor parallelism (its logits would hold
        the gathered vocabulary, which the fused op does not read).
    """
    loss_fn = per_token_loss if per_token else legacy_loss
    return partial(_checked_forward_step, settings=settings, loss_fn=loss_fn)


def _checked_forward_step(data_iterator, model, *, settings: LossSettings, loss_fn):
    if getattr(unwrap_model(model), "parallel_output", True) is False and settings.tp_group is not None:
        raise ValueError(
            "the model was built with parallel_output=False, so its logits hold the gathered vocabulary; build the "
            "GPTModel with parallel_output=True (the fused op reads the [b, S, V/tp] shard on settings.tp_group)"
        )
    return forward_step(data_iterator, model, settings=settings, loss_fn=loss_fn)
