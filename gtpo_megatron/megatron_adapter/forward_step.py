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
from typing import TYPE_CHECKING

import torch

from gtpo_megatron.batch import TrainBatch
from gtpo_megatron.ops import LossSpec, PackedLayout, policy_objective, vocab_parallel_logprobs_entropy

if TYPE_CHECKING:
    from gtpo_megatron.megatron_adapter.moe.router_losses import RouterLossWeights
    from gtpo_megatron.megatron_adapter.moe.routing_replay import RoutingReplay


@dataclass(kw_only=True)
class MicroBatch(TrainBatch):
    """One micro-batch on the model's device: the rows' record and the model's inputs.

    ``position_ids`` ``[b, S]``; ``attention_mask`` of the local spec (None: Transformer Engine's causal mask);
    ``source_rows``: the policy batch's row of each sequence (-1: a padding row). A packed micro-batch is one row
    ``[1, N]`` holding ``layout.num_sequences`` sequences: per-token tensors packed, per-sequence ones (``[n]``) not,
    and ``packed_seq_params`` Megatron's THD description of it with Transformer Engine.
    """

    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None = None
    source_rows: tuple[int, ...] = ()
    layout: PackedLayout | None = None
    packed_seq_params: object | None = None

    @classmethod
    def of(cls, rows: TrainBatch, *, position_ids: torch.Tensor, **inputs) -> MicroBatch:
        """``rows`` (a ``TrainBatch`` already cut and on the device) with the model's inputs (the other fields)."""
        record = {f.name: getattr(rows, f.name) for f in dataclasses.fields(TrainBatch)}
        return cls(**record, position_ids=position_ids, **inputs)

    def unpacked(self) -> MicroBatch:
        """One sequence per row, ``[n, L]`` (``ops.PackedLayout.unpack``); ``self`` when not packed."""
        if self.layout is None:
            return self
        rows = self.apply(lambda t: self.layout.unpack(t) if t.dim() >= 2 else t)
        return dataclasses.replace(
            rows, position_ids=self.layout.unpack(self.position_ids), attention_mask=None, layout=None,
            packed_seq_params=None,
        )  # fmt: skip


@dataclass(frozen=True)
class ForwardSettings:
    """The loss closure's settings for every micro-batch of a step.

    ``tp_group`` shards the vocabulary (None: unsharded; columns ``>= vocab_size`` are padding); ``entropy_temperature``
    None means ``temperature``; ``loss`` None is forward-only mode; ``normalizer`` the global ``N`` (fp32 scalar) and
    ``loss_scale`` ``M * D``; ``routing_replay`` the model's routers, fed each micro-batch's ``routed_experts``
    (None: routers choose on their own); ``router_losses`` weighs the routers' losses of each micro-batch (None:
    Megatron's ``1 / M``).
    """

    tp_group: object
    vocab_size: int
    temperature: float
    chunk_size: int | None
    loss: LossSpec | None = None
    normalizer: torch.Tensor | None = None
    loss_scale: float = 1.0
    entropy_temperature: float | None = None
    routing_replay: RoutingReplay | None = None
    router_losses: RouterLossWeights | None = None


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
    """``(S / N * loss_scale, metrics)``; forward-only (``loss=None``): ``(0, {"logprobs", "entropy"})`` ``[b, S]``.

    A packed micro-batch is unpacked first: the objective and the forward-only values see one sequence per row.
    """
    logprobs, entropy = token_logprobs_entropy(logits, batch, settings)
    if batch.layout is not None:
        logprobs, entropy = batch.layout.unpack(logprobs), batch.layout.unpack(entropy)
        batch = batch.unpacked()
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
    if settings.routing_replay is not None:
        settings.routing_replay.set_micro_batch(batch.routed_experts)
    if settings.router_losses is not None:
        settings.router_losses.next_micro_batch()
    inputs = {} if batch.packed_seq_params is None else {"packed_seq_params": batch.packed_seq_params}
    output = model(batch.input_ids, batch.position_ids, batch.attention_mask, **inputs)
    return output, partial(loss_fn, batch=batch, settings=settings)
