"""``forward_step`` and loss closure for ``megatron.core.pipeline_parallel.get_forward_backward_func()``.

Every stage receives the same ``MicroBatch``; the first reads ``input_ids``, the last everything else. One forward,
no pass before it (docs/algorithm.md sections 1 and 4): one call of the vocab-parallel log-prob op on the TP group
gives the log-probs (loss temperature) and the detached entropy, and ``ops.policy_objective`` decides delta_i and
``A_i - gamma <H>_i`` from this micro-batch. The loss closure returns Megatron's legacy 2-tuple ``(S / N * M * D,
metrics)``; docs/architecture.md ("Loss scaling in Megatron's schedule") derives why the optimizer then sees
``grad J`` exactly.
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
    """One micro-batch on the model's device: the rows' record, ``position_ids`` ``[b, S]``, ``attention_mask``."""

    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None = None

    @classmethod
    def of(cls, rows: TrainBatch, *, position_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> MicroBatch:
        """``rows`` (a ``TrainBatch`` already cut and on the device) with the model's inputs."""
        record = {f.name: getattr(rows, f.name) for f in dataclasses.fields(TrainBatch)}
        return cls(**record, position_ids=position_ids, attention_mask=attention_mask)


@dataclass(frozen=True)
class ForwardSettings:
    """The loss closure's settings for every micro-batch of a step.

    ``tp_group`` shards the vocabulary (None: unsharded; columns ``>= vocab_size`` are padding); ``entropy_temperature``
    None means ``temperature``; ``loss`` None is forward-only mode; ``normalizer`` the global ``N`` (fp32 scalar) and
    ``loss_scale`` ``M * D``.
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
    """Per-token ``(logprobs, entropy)`` ``[b, S]`` fp32 nats (``TrainBatch`` columns) of ``[b, S, V/tp]`` logits.

    Entropy is detached; column 0 and columns off ``response_mask`` are 0. Collectives: two all-reduces on
    ``settings.tp_group``.
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
    """``(S / N * loss_scale, metrics)``; forward-only (``loss=None``): ``(0, {"logprobs", "entropy"})`` ``[b, S]``."""
    logprobs, entropy = token_logprobs_entropy(logits, batch, settings)
    if settings.loss is None:
        zero = logprobs.new_zeros(())
        return zero, {"logprobs": logprobs.detach(), "entropy": entropy}
    loss, metrics, _ = policy_objective(logprobs, entropy, batch, settings.loss, settings.normalizer)
    return loss * settings.loss_scale, metrics


def forward_step(data_iterator, model, *, settings: ForwardSettings, loss_fn=policy_loss_closure):
    """Megatron ``forward_step_func``: run this stage on the next ``MicroBatch``; return output and loss closure.

    Bind ``settings`` (and optionally ``loss_fn(logits, batch, settings)``) with ``functools.partial``.
    """
    batch: MicroBatch = next(data_iterator)
    output = model(batch.input_ids, batch.position_ids, batch.attention_mask)
    return output, partial(loss_fn, batch=batch, settings=settings)
