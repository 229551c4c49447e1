"""``forward_step`` and loss closure for ``megatron.core.pipeline_parallel.get_forward_backward_func()``.

Micro-batch layout (a ``MicroBatch``; every stage receives the same one, the first stage reads ``input_ids``, the
last stage everything else): ``input_ids`` ``[b, S]``; per-token tensors ``[b, S]`` where column ``s`` describes
the prediction of ``input_ids[:, s]`` from ``input_ids[:, :s]`` (``TrainBatch`` convention), so column 0 is always
0 / False; ``advantages`` ``[b]`` (the raw A_i). Sequences are right padded; padded columns are causally invisible
to real tokens and masked out of the loss, so padding never changes a result. Per-token weights (GTPO lambda,
section 3) and the per-row decisions travel with their rows.

One forward, no pass before it (docs/algorithm.md sections 1 and 4): the loss closure gets the log-probs at the loss
temperature and the (detached) entropy at ``entropy_temperature`` from one call of the log-prob op, and
``ops.policy_objective`` decides each completion's delta_i and ``A_i - gamma <H>_i`` from its own tokens in this
micro-batch; it also measures the train/rollout mismatch (``rollout_logprobs``) of this same forward.

Log-probs come from the vocab-parallel logits ``[b, S, V/tp]`` (``parallel_output=True``) through
``ops.vocab_parallel_logprobs_entropy`` on the TP group: the vocabulary is never gathered, padded vocabulary
columns (``>= vocab_size``) are excluded.

Normalisation arithmetic (one contract for the whole optimizer step)
--------------------------------------------------------------------
Let ``N`` be the step's global normaliser: ``ops.compute_normalizer`` summed over all ``M`` micro-batches of a
rank and all-reduced (SUM) over the ``D`` data-parallel ranks, computed *before* the schedule runs. The ops loss
of micro-batch ``m`` on DP rank ``d`` is ``l_dm = S_dm / N`` where ``S_dm`` is its un-normalised sum, so the
objective of the step is ``J = sum_d sum_m l_dm``. Megatron then does, with ``calculate_per_token_loss=False`` and
our 2-tuple loss return:

1. the schedule (``forward_step_calc_loss``) divides the returned loss by ``M`` before ``backward``;
2. ``finalize_model_grads`` -> DDP ``finish_grad_sync`` averages the gradient buffers over the DP group (pre-scale
   by ``1/D`` then SUM, or an AVG collective: the same ``1/D`` either way; the distributed optimizer's
   reduce-scatter uses the same factor).

So the loss closure returns ``l_dm * M * D``: the gradient that reaches the optimizer is
``(1/D) sum_d (1/M) sum_m grad(M * D * l_dm) = grad J`` exactly, independent of how rows are split into
micro-batches or DP ranks. Context parallelism is not used (``cp_size = 1``, so Megatron's ``* cp_size`` is 1).
Reported ``loss`` metrics are the unscaled ``l_dm``, summed over micro-batches and DP ranks, i.e. ``J``.

``N`` comes from the response masks only, so it does not depend on the entropy filter decided inside the forward:
a filtered completion (delta_i = 0) still counts in ``N`` and contributes 0 to ``S_dm``, which is
docs/algorithm.md section 1's ``1/G`` over all completions of the group (filtered ones included), for every aggregation.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from gtpo_megatron.ops import LossSpec, policy_objective, vocab_parallel_logprobs_entropy
from gtpo_megatron.rollout.batch import mismatch_sums


@dataclass
class MicroBatch:
    """One micro-batch, already on the model's device. Shapes: ``[b, S]`` unless noted; see module docstring."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    response_mask: torch.Tensor
    token_weights: torch.Tensor | None = None
    advantages: torch.Tensor | None = None  # [b]
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    keep_mask: torch.Tensor | None = None  # [b] bool
    seq_entropy: torch.Tensor | None = None  # [b]
    rollout_logprobs: torch.Tensor | None = None


@dataclass(frozen=True)
class LossSettings:
    """Everything the loss closure needs besides the micro-batch (shared by all micro-batches of a step).

    ``temperature`` is the softmax temperature of the log-probs, ``entropy_temperature`` that of the entropy (None:
    the same); ``loss`` is the step objective (``ops.LossSpec``), ``None`` for the forward-only mode that returns
    per-token values instead of a loss. ``normalizer`` is the global ``N`` (fp32 scalar tensor); ``loss_scale`` is
    ``M * D`` (module docstring).
    """

    tp_group: object
    vocab_size: int
    temperature: float
    chunk_size: int | None
    loss: LossSpec | None = None
    normalizer: torch.Tensor | None = None
    loss_scale: float = 1.0
    entropy_temperature: float | None = None


def token_logprobs_entropy(
    logits: torch.Tensor, batch: MicroBatch, settings: LossSettings
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs and entropy in the ``TrainBatch`` column convention.

    Args:
        logits: ``[b, S, V/tp]`` vocab-parallel logits of this TP rank (position ``s`` predicts token ``s+1``).
        batch: the micro-batch (``input_ids`` and ``response_mask`` are read).
        settings: the step's ``LossSettings`` (TP group, vocabulary size, temperatures, chunk size).

    Returns:
        ``(logprobs, entropy)``, both ``[b, S]`` fp32 nats (log-probs at ``settings.temperature``, entropy at
        ``settings.entropy_temperature``); column 0 and every column off ``response_mask`` are 0. ``logprobs``
        carries gradient w.r.t. ``logits``; ``entropy`` is detached.

    Collectives: two all-reduces on ``settings.tp_group`` (inside the ops function).
    """
    # Run the op on all S positions (no copy of the contiguous logits); position S-1 gets a dummy target 0 and is
    # dropped by the shift below, so it never reaches the result or the gradient.
    targets = torch.nn.functional.pad(batch.input_ids[:, 1:], (0, 1))
    logprobs, entropy = vocab_parallel_logprobs_entropy(
        logits,
        targets,
        tp_group=settings.tp_group,
        vocab_size=settings.vocab_size,
        temperature=settings.temperature,
        entropy_temperature=settings.entropy_temperature,
        chunk_size=settings.chunk_size,
        with_entropy=True,
    )
    logprobs = torch.nn.functional.pad(logprobs[:, :-1], (1, 0))
    entropy = torch.nn.functional.pad(entropy[:, :-1], (1, 0))
    return torch.where(batch.response_mask, logprobs, 0.0), torch.where(batch.response_mask, entropy, 0.0)


def policy_loss_closure(logits: torch.Tensor, batch: MicroBatch, settings: LossSettings):
    """The loss closure ``forward_step`` binds (Megatron's legacy 2-tuple contract, see the module docstring).

    Args:
        logits: ``[b, S, V/tp]`` last-stage output.
        batch: the micro-batch the logits belong to.
        settings: the step's ``LossSettings`` (``loss=None``: forward-only).

    Returns:
        Training (``settings.loss`` set): ``(l * loss_scale, metrics)`` with ``(l, metrics)`` of
        :func:`policy_loss` (``l = S_dm / N``; delta_i and ``A_i - gamma <H>_i`` from ``batch.seq_entropy`` when
        given, else from this forward's entropy). Forward-only (``loss=None``): ``(0, {"logprobs", "entropy"})``
        with the ``[b, S]`` tensors of ``token_logprobs_entropy``.
    """
    logprobs, entropy = token_logprobs_entropy(logits, batch, settings)
    if settings.loss is None:
        zero = logprobs.new_zeros(())
        return zero, {"logprobs": logprobs.detach(), "entropy": entropy}
    loss, metrics = policy_loss(logprobs, entropy, batch, settings.loss, settings.normalizer)
    return loss * settings.loss_scale, metrics


def policy_loss(
    logprobs: torch.Tensor, entropy: torch.Tensor | None, batch: MicroBatch, spec: LossSpec, normalizer: torch.Tensor
):
    """The objective of one micro-batch from its per-token log-probs (the loss half of ``policy_loss_closure``).

    ``ops.policy_objective``: the entropy filter's delta_i and ``A_i - gamma <H>_i`` of ``spec`` are decided here
    from each completion's own entropy (``batch.seq_entropy`` when given, else ``entropy``), then the registered
    loss.

    Args:
        logprobs: ``[b, S]`` fp32 log pi_theta in the ``TrainBatch`` column convention, differentiable.
        entropy: ``[b, S]`` detached token entropy in nats at ``spec.entropy_temperature``, or None (then
            ``batch.seq_entropy`` is needed when ``spec`` filters or penalises).
        batch: the micro-batch (``response_mask``, ``advantages`` (the raw A_i), ``token_weights``, ``keep_mask``,
            ``seq_entropy``, ``old_logprobs``, ``ref_logprobs``, ``rollout_logprobs`` are read;
            ``token_weights=None`` means weight 1 on every response token).
        spec: the step objective.
        normalizer: fp32 scalar the loss sum is divided by (the step's global ``N``; 1 gives the plain sum).

    Returns:
        ``(loss, metrics)``: the loss ``S / normalizer`` (fp32 scalar, differentiable w.r.t. ``logprobs``) and
        detached fp32 scalars: the objective's sums/counts plus ``loss``; with ``rollout_logprobs``,
        ``mismatch_abs_logprob_diff`` and ``mismatch_prob_ratio_err`` (sums over response tokens,
        ``rollout.batch.mismatch_sums``); with ``old_logprobs``, ``logprob_diff_max`` (max |log pi_theta - log
        pi_old| on response tokens; reduce with MAX).

    Raises:
        ValueError: whatever the objective rejects (shapes, aggregation, KL settings, no entropy for a filter).
    """
    token_weights = batch.token_weights
    if token_weights is None:
        token_weights = batch.response_mask.float()
    loss, metrics, _ = policy_objective(
        policy_logprobs=logprobs,
        entropy=entropy,
        raw_advantages=batch.advantages,
        token_weights=token_weights,
        response_mask=batch.response_mask,
        normalizer=normalizer,
        spec=spec,
        keep_mask=batch.keep_mask,
        seq_entropy=batch.seq_entropy,
        old_logprobs=batch.old_logprobs,
        ref_logprobs=batch.ref_logprobs,
    )
    metrics = dict(metrics, loss=loss.detach().float())
    if batch.rollout_logprobs is not None:
        sums = mismatch_sums(logprobs.detach(), batch.rollout_logprobs, batch.response_mask)
        metrics["mismatch_abs_logprob_diff"] = sums["abs_logprob_diff"]
        metrics["mismatch_prob_ratio_err"] = sums["prob_ratio_err"]
    if batch.old_logprobs is not None:
        diff = torch.where(batch.response_mask, (logprobs.detach() - batch.old_logprobs).abs(), 0.0)
        metrics["logprob_diff_max"] = diff.max() if diff.numel() else diff.new_zeros(())
    return loss, metrics


def forward_step(data_iterator, model, *, settings: LossSettings, loss_fn=policy_loss_closure):
    """Megatron ``forward_step_func``: run this stage on the next ``MicroBatch``; return output and loss closure.

    On non-first stages ``input_ids`` is ignored by ``GPTModel`` (the activation comes from the previous stage);
    on non-last stages the closure is never called. Bind ``settings`` (and another ``loss_fn(logits, batch,
    settings)``, e.g. ``loss_forms.per_token_loss``) with ``functools.partial``.
    """
    batch: MicroBatch = next(data_iterator)
    output = model(batch.input_ids, batch.position_ids, batch.attention_mask)
    return output, partial(loss_fn, batch=batch, settings=settings)
