"""``TrainBatch``: the step's per-row record, from collation (``rollout.batch``) to the loss (``ops.policy_objective``).

The one list of per-row tensors: row selection, padding, devices and unpacking go through
:meth:`TrainBatch.apply`; per-token tensors are ``[B, S, ...]`` (dim >= 2), per-sequence ones ``[B]``.
Masks: docs/architecture.md ("Mask vocabulary"). B rows group by group, S padded length;
column ``s`` describes the prediction of ``input_ids[:, s]`` (column 0 is never a response token). Torch only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

RecordT = TypeVar("RecordT", bound="TrainBatch")


@dataclass(kw_only=True)
class TrainBatch:
    """One data-parallel rank's rows of a step (or all of them), right padded; tensors on CPU until the policy.

    Attributes:
        input_ids: ``[B, S]`` int64 prompt+response token ids; padding holds any id.
        response_mask: ``[B, S]`` bool, True on response tokens.
        token_mask: ``[B, S]`` bool, True on prompt and response tokens (throughput metrics); None: not known.
        rollout_logprobs: ``[B, S]`` fp32 engine log-probs (nats, 0 off the response); the loss measures the
            train/rollout mismatch when set.
        truncated: ``[B]`` bool, completion cut at the token limit.
        advantages: ``[B]`` fp32 raw group-relative A_i (the loss subtracts ``gamma <H>_i``).
        token_weights: ``[B, S]`` fp32 conflict weight lambda, 0 off the response; None: 1 on every response token.
        loss_row_mask: ``[B]`` bool, False on rows removed from the objective (loss and normaliser); None: all in.
        seq_entropy: ``[B]`` fp32 <H>_i (nats) of a pass before the update; None: measured by the training forward.
        old_logprobs: ``[B, S]`` fp32 log pi_old (nats); None: one update per batch (ratio 1 with gradient).
        ref_logprobs: ``[B, S]`` fp32 reference-policy log-probs (nats) of the KL term, else None.
        routed_experts: ``[B, S, L, K]`` int16, the engine's experts of the *input* token in column ``s`` in each of
            the L MoE layers, each id plus one; 0: not recorded (the router takes its own top-k). Set only with
            ``rollout.routing_replay=rollout`` (``megatron_adapter.moe.routing_replay``, docs/moe.md); zero padding
            therefore means "no record" wherever a layout owner pads.
    """

    input_ids: torch.Tensor
    response_mask: torch.Tensor
    token_mask: torch.Tensor | None = None
    rollout_logprobs: torch.Tensor | None = None
    truncated: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    token_weights: torch.Tensor | None = None
    loss_row_mask: torch.Tensor | None = None
    seq_entropy: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    routed_experts: torch.Tensor | None = None

    def apply(self: RecordT, fn: Callable[[torch.Tensor], torch.Tensor]) -> RecordT:
        """A copy with ``fn`` applied to every record tensor that is set (fields of subclasses are kept as they are)."""
        changes = {}
        for f in dataclasses.fields(TrainBatch):
            value = getattr(self, f.name)
            if value is not None:
                changes[f.name] = fn(value)
        return dataclasses.replace(self, **changes)

    def select(self: RecordT, rows: slice | torch.Tensor) -> RecordT:
        """Rows ``rows`` of every record tensor (the data-parallel share, a micro-batch)."""
        return self.apply(lambda t: t[rows])

    @property
    def loss_mask(self) -> torch.Tensor:
        """``[B, S]`` bool: ``response_mask`` on the rows of ``loss_row_mask``; what the loss and normaliser count."""
        if self.loss_row_mask is None:
            return self.response_mask
        return self.response_mask & self.loss_row_mask.unsqueeze(-1)

    @property
    def num_sequences(self) -> int:
        """B, the number of rows."""
        return int(self.input_ids.shape[0])

    def sequence_lengths(self) -> list[int]:
        """Prompt + response tokens of each row (``token_mask`` counts; a row's sequence is its prefix).

        Raises:
            ValueError: ``token_mask`` is None.
        """
        if self.token_mask is None:
            raise ValueError(
                "token-budget micro-batches need batch.token_mask (True on each row's prompt and response tokens) "
                "to know the sequence lengths; set it, or unset optim.max_tokens_per_micro_batch"
            )
        return [int(n) for n in self.token_mask.sum(dim=-1)]
