"""``forward_step`` and loss closure for ``megatron.core.pipeline_parallel.get_forward_backward_func()``.

Every stage receives the same ``MicroBatch`` (the record of ``gtpo_megatron.batch`` plus the model's inputs); the
first reads ``input_ids``, the last everything else. Right padding is causally invisible and masked out of the loss.

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

import dataclasses
from dataclasses import dataclass
from functools import partial

import torch

from gtpo_megatron.batch import TrainBatch
from gtpo_megatron.ops import LossSpec, policy_objective, vocab_parallel_logprobs_entropy


@dataclass(kw_only=True)
class MicroBatch(TrainBatch):
    """One micro-batch on the model's device: the rows' record (``[b, S]`` / ``[b]``) plus the model's inputs.

    ``position_ids`` ``[b, S]`` int64; ``attention_mask`` the mask ``GPTModel`` takes (e.g. the ``[1, 1, S, S]``
    causal mask of the local layer spec, ``model.causal_attention_mask``), or None.
    """

    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None = None

    @classmethod
    def of(cls, rows: TrainBatch, *, position_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> MicroBatch:
        """``rows`` (a ``TrainBatch`` already cut and on the device) with the model's inputs."""
        record = {f.name: getattr(rows, f.name) for f in dataclasses.fields(TrainBatch)}
        return cls(**record, position_ids=position_ids, attention_mask=attention_mask)


@dataclass(frozen=True)
class ForwardSettings:
    """What the forward step's loss closure needs besides the micro-batch (shared by all micro-batches of a step).

    ``tp_group`` shards the logits' vocabulary (None: unsharded); columns ``>= vocab_size`` are padding;
    ``temperature`` / ``entropy_temperature`` (None: the same) are the log-prob / entropy softmax temperatures;
    ``chunk_size`` tokens per chunk of the log-prob op (None: one). ``loss`` is the step objective, None for the
    forward-only mode that returns per-token values; ``normalizer`` the global ``N`` (fp32 scalar) and
    ``loss_scale`` ``M * D`` (module docstring).
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
    logits: torch.Tensor, batch: MicroBatch, settings: ForwardSettings
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``(logprobs, entropy)`` ``[b, S]`` fp32 nats in the ``TrainBatch`` column convention.

    ``logits``: ``[b, S, V/tp]`` vocab-parallel logits (position ``s`` predicts token ``s+1``); ``batch.input_ids``
    and ``batch.response_mask`` are read. Log-probs at ``settings.temperature`` (gradient w.r.t. ``logits``),
    entropy at ``settings.entropy_temperature`` (detached); column 0 and every column off ``response_mask`` are 0.

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


def policy_loss_closure(logits: torch.Tensor, batch: MicroBatch, settings: ForwardSettings):
    """The loss closure ``forward_step`` binds (Megatron's legacy 2-tuple contract, see the module docstring).

    Training (``settings.loss`` set): ``(l * loss_scale, metrics)`` with ``(l, metrics)`` of
    ``ops.policy_objective`` (``l = S_dm / N``). Forward-only (``loss=None``): ``(0, {"logprobs", "entropy"})``
    with the ``[b, S]`` tensors of :func:`token_logprobs_entropy`.
    """
    logprobs, entropy = token_logprobs_entropy(logits, batch, settings)
    if settings.loss is None:
        zero = logprobs.new_zeros(())
        return zero, {"logprobs": logprobs.detach(), "entropy": entropy}
    loss, metrics, _ = policy_objective(logprobs, entropy, batch, settings.loss, settings.normalizer)
    return loss * settings.loss_scale, metrics


def forward_step(data_iterator, model, *, settings: ForwardSettings, loss_fn=policy_loss_closure):
    """Megatron ``forward_step_func``: run this stage on the next ``MicroBatch``; return output and loss closure.

    On non-first stages ``input_ids`` is ignored by ``GPTModel`` (the activation comes from the previous stage);
    on non-last stages the closure is never called. Bind ``settings`` (and another ``loss_fn(logits, batch,
    settings)``, e.g. ``loss_forms.per_token_loss``) with ``functools.partial``.
    """
    batch: MicroBatch = next(data_iterator)
    output = model(batch.input_ids, batch.position_ids, batch.attention_mask)
    return output, partial(loss_fn, batch=batch, settings=settings)
