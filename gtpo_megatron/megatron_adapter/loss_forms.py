"""The policy loss in Megatron's two ``loss_func`` conventions, for a caller's own forward step (``plugin``'s loss).

* per-token form ``(S_dm, c_dm, metrics)`` (:func:`per_token_loss`), for ``calculate_per_token_loss=True``;
* legacy form ``(S_dm / N * M * D, metrics)`` (:func:`legacy_loss`), with the step's global ``N``.

docs/architecture.md ("Loss scaling in Megatron's schedule") derives both and the metrics' ``[numerator,
denominator]`` convention. Log-probs come from ``[b, S, V/tp]`` logits (``forward_step.token_logprobs_entropy``)
or from the caller (``*_from_logprobs``), in ``TrainBatch`` columns. A packed row (``ops.PackedLayout``) is
unpacked to one sequence per row first. Reported metrics: ``gtpo/loss`` (``J``) and ``gtpo/`` ``clip_frac``,
``ratio_mean``, ``entropy_mean``, ``kl_mean``, ``amplified_frac`` (weight > 1), ``zero_weight_frac`` (weight 0);
with ``spec.off_policy_correction`` (the behaviour log-probs in ``batch.rollout_logprobs``, docs/algorithm.md
section 11) ``is_weight_mean``, ``is_capped_frac`` and ``is_undefined_frac``.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import torch

from gtpo_megatron.megatron_adapter.external_model import unwrap_model
from gtpo_megatron.megatron_adapter.forward_step import (
    ForwardSettings,
    MicroBatch,
    forward_step,
    token_logprobs_entropy,
)
from gtpo_megatron.ops import MEANS, LossSpec, PackedLayout, compute_normalizer, policy_objective
from gtpo_megatron.parallel.collectives import all_reduce_sum

_REPORTED = (  # of MEANS; the off-policy weights only with a correction
    "clip_frac", "ratio_mean", "entropy_mean", "kl_mean", "amplified_frac", "zero_weight_frac", "is_weight_mean",
    "is_capped_frac", "is_undefined_frac",
)  # fmt: skip


def forward_settings(
    spec: LossSpec,
    *,
    vocab_size: int,
    tp_group=None,
    chunk_size: int | None = None,
    normalizer: torch.Tensor | None = None,
    num_microbatches: int = 1,
    dp_size: int = 1,
) -> ForwardSettings:
    """The forward step's settings for one optimizer step of ``spec``, with its entropy filter and penalty off.

    ``plugin.compute_gtpo_weights`` already put those in ``advantages`` and ``token_weights``. Legacy form only:
    ``normalizer`` ``N``, ``num_microbatches`` ``M``, ``dp_size`` ``D``.

    Raises:
        ValueError: ``num_microbatches`` or ``dp_size`` < 1.
    """
    if num_microbatches < 1 or dp_size < 1:
        raise ValueError(f"num_microbatches={num_microbatches} and dp_size={dp_size} must both be >= 1")
    return ForwardSettings(
        tp_group=tp_group,
        vocab_size=vocab_size,
        temperature=spec.temperature,
        entropy_temperature=spec.entropy_temperature,
        chunk_size=chunk_size,
        loss=dataclasses.replace(spec, entropy_filter="off", entropy_penalty=0.0),
        normalizer=normalizer,
        loss_scale=float(num_microbatches * dp_size),
    )


def per_token_loss(
    logits: torch.Tensor, batch: MicroBatch, settings: ForwardSettings, packed: PackedLayout | None = None
):
    """Per-token form ``(S, c, metrics)`` from ``[b, S, V/tp]`` logits (``[1, N, V/tp]`` with ``packed``).

    ``c`` is the int32 count of ``batch.loss_mask``. Collectives: two all-reduces on ``settings.tp_group``.

    Raises:
        ValueError: ``settings.loss`` is None, shape/dtype mismatches, ids outside the vocabulary, a logits width
            inconsistent with the TP group, a bad ``packed`` layout, ``kl_coef > 0`` without ``ref_logprobs``.
    """
    logprobs, entropy = token_logprobs_entropy(logits, batch, settings)
    return per_token_loss_from_logprobs(logprobs, batch, settings, entropy=entropy, packed=packed)


def legacy_loss(logits: torch.Tensor, batch: MicroBatch, settings: ForwardSettings, packed: PackedLayout | None = None):
    """Legacy form ``(S / N * M * D, metrics)`` (as :func:`per_token_loss`; two all-reduces on the TP group).

    Raises:
        ValueError: ``settings.normalizer`` is None, and the errors of :func:`per_token_loss`.
    """
    logprobs, entropy = token_logprobs_entropy(logits, batch, settings)
    return legacy_loss_from_logprobs(logprobs, batch, settings, entropy=entropy, packed=packed)


def per_token_loss_from_logprobs(
    logprobs: torch.Tensor,
    batch: MicroBatch,
    settings: ForwardSettings,
    *,
    entropy: torch.Tensor | None = None,
    packed: PackedLayout | None = None,
):
    """:func:`per_token_loss` from ``[b, S]`` fp32 log-probs (Megatron-LM's ``[b, S-1]``: ``F.pad(x, (1, 0))``)."""
    loss_sum, count, metrics = _summed(logprobs, entropy, batch, settings, packed)
    return loss_sum, count.to(torch.int), metrics


def legacy_loss_from_logprobs(
    logprobs: torch.Tensor,
    batch: MicroBatch,
    settings: ForwardSettings,
    *,
    entropy: torch.Tensor | None = None,
    packed: PackedLayout | None = None,
):
    """:func:`legacy_loss` from log-probs the caller has (as :func:`per_token_loss_from_logprobs`). No collectives.

    Raises:
        ValueError: ``settings.normalizer`` is None, and the errors of :func:`per_token_loss`.
    """
    if settings.normalizer is None:
        raise ValueError(
            "the legacy (2-tuple) loss needs settings.normalizer, the step's global normaliser N "
            "(parallel.global_normalizer over every micro-batch and data-parallel rank); or use the per-token form"
        )
    loss_sum, _, metrics = _summed(logprobs, entropy, batch, settings, packed)
    return loss_sum / settings.normalizer * settings.loss_scale, metrics


def _summed(logprobs, entropy, batch: MicroBatch, settings: ForwardSettings, packed: PackedLayout | None):
    """``(S, count, reported metrics)`` of one micro-batch (one packed row unpacked first)."""
    spec = settings.loss
    if spec is None:
        raise ValueError("settings.loss is None; build the settings with forward_settings(spec, ...)")
    if packed is not None:
        logprobs = packed.unpack(logprobs)
        entropy = None if entropy is None else packed.unpack(entropy)
        batch = dataclasses.replace(batch, layout=packed).unpacked()
    one = torch.ones((), dtype=torch.float32, device=logprobs.device)
    loss_sum, sums, _ = policy_objective(logprobs, entropy, batch, spec, one)
    count = compute_normalizer(batch.loss_mask, spec.aggregation, max_response_length=spec.max_response_length)
    return loss_sum, count, _report(loss_sum.detach(), count, sums)


def _report(loss_sum: torch.Tensor, count: torch.Tensor, sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    pairs = {"loss": (loss_sum, count)}
    pairs.update({name: (sums[MEANS[name][0]], sums[MEANS[name][1]]) for name in _REPORTED if MEANS[name][0] in sums})
    return {f"gtpo/{name}": torch.stack([num.float(), den.float()]) for name, (num, den) in pairs.items()}


def reduce_loss_metrics(store: list[dict[str, torch.Tensor]], *, group) -> dict[str, float]:
    """``{name: numerator / denominator}`` floats (0 for a 0 denominator) of the schedule's per-micro-batch dicts.

    Summed over micro-batches and the DP ``group``. Collectives: one SUM all-reduce of a ``[K, 2]`` tensor.
    """
    if not store:
        return {}
    names = sorted(store[0])
    totals = torch.stack([torch.stack([d[name] for d in store]).sum(dim=0) for name in names])  # [K, 2]
    totals = all_reduce_sum(totals, group=group)
    ratios = torch.where(totals[:, 1] > 0, totals[:, 0] / totals[:, 1].clamp(min=1e-30), 0.0)
    return dict(zip(names, ratios.tolist()))


def make_forward_step(settings: ForwardSettings, *, per_token: bool = True):
    """Megatron's ``forward_step_func`` for a caller's ``GPTModel``, binding :func:`per_token_loss` or the legacy form.

    The returned function raises ValueError for a model built with ``parallel_output=False`` under TP.
    """
    loss_fn = per_token_loss if per_token else legacy_loss
    return partial(_checked_forward_step, settings=settings, loss_fn=loss_fn)


def _checked_forward_step(data_iterator, model, *, settings: ForwardSettings, loss_fn):
    if getattr(unwrap_model(model), "parallel_output", True) is False and settings.tp_group is not None:
        raise ValueError(
            "the model was built with parallel_output=False, so its logits hold the gathered vocabulary; build the "
            "GPTModel with parallel_output=True (the fused op reads the [b, S, V/tp] shard on settings.tp_group)"
        )
    return forward_step(data_iterator, model, settings=settings, loss_fn=loss_fn)
