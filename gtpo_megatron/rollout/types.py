"""Typed containers that cross module boundaries between rollout, trainer and policy.

Notation (``docs/algorithm.md``): P prompts, G completions per prompt (``group_size``), B = P*G sequences laid
out group by group (rows ``g*G .. g*G+G-1`` are prompt g), S = padded prompt+response length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Completion:
    """One sampled completion of one prompt, as the rollout engine returns it.

    ``token_ids``: response token ids (EOS included when generated; never padded).
    ``rollout_logprobs``: the engine's log-probability (nats) of each sampled token, same length as ``token_ids``.
    ``finish_reason``: ``"stop"`` (EOS or a stop string) or ``"length"`` (truncated at max tokens).
    """

    token_ids: list[int]
    rollout_logprobs: list[float]
    text: str
    finish_reason: str


@dataclass
class PromptCompletions:
    """The G completions of one prompt (``prompt_ids`` is the tokenised chat-templated prompt)."""

    prompt_ids: list[int]
    completions: list[Completion]


@dataclass
class TrainBatch:
    """One data-parallel rank's share of a step, padded to a rectangle, ready for the policy.

    Every tensor is on CPU; the policy moves what it needs. Rows are sequences (prompt then response, right
    padded). Column ``s`` of the per-token tensors describes the prediction of ``input_ids[:, s]`` from the prefix
    ``input_ids[:, :s]``, so column 0 is never a response token.

    Attributes:
        input_ids: ``[B, S]`` int64 prompt+response token ids; padding holds ``pad_token_id`` (any id).
        attention_mask: ``[B, S]`` bool, True on real (prompt or response) tokens.
        response_mask: ``[B, S]`` bool, True on response tokens (the tokens the loss acts on).
        old_logprobs: ``[B, S]`` fp32, log pi_old of each token in nats (0 off the response); filled by the
            trainer's no-grad pass before the update when there are several updates per batch (docs/algorithm.md section
            1: r = pi_theta / pi_old), else None.
        advantages: ``[B]`` fp32 group-relative advantage A_i (docs/algorithm.md section 2); the loss subtracts
            ``gamma <H>_i`` (section 4, ``ops.policy_objective``).
        token_weights: ``[B, S]`` fp32 per-token multiplier decided before the forward: conflict weight lambda
            (section 3, with any ``normalize_by_conflicts`` division and DAPO's overlong filter), 0 off the
            response; the loss multiplies in the entropy filter's delta_i.
        ref_logprobs: ``[B, S]`` fp32 reference-policy log-probs for the optional GRPO KL term, else None.
        keep_mask: ``[B]`` bool row decision made without the entropy (``loss_row_mask``), else None (all).
        seq_entropy: ``[B]`` fp32 <H>_i in nats from a pass before the update, else None (the loss measures it in
            the training forward).
        rollout_logprobs: ``[B, S]`` fp32 log-probs of the rollout engine, set when the loss should measure the
            train/rollout mismatch; else None.
        loss_row_mask: ``[B]`` bool, True on rows in the objective; False on rows a switch removes (uniform-reward
            groups under ``skip_uniform_groups``, truncated rows under ``overlong_filter``): they leave the loss and
            its normaliser (``loss_mask``). None: every row is in the objective.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    old_logprobs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    token_weights: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    loss_row_mask: torch.Tensor | None = None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    keep_mask: torch.Tensor | None = None
    seq_entropy: torch.Tensor | None = None
    rollout_logprobs: torch.Tensor | None = None

    @property
    def loss_mask(self) -> torch.Tensor:
        """``[B, S]`` bool: ``response_mask`` on the rows of ``loss_row_mask``, False on removed rows.

        The mask the loss and its normaliser take (``ops.losses``: which rows count); entropy-filtered rows keep
        their response tokens here.
        """
        if self.loss_row_mask is None:
            return self.response_mask
        return self.response_mask & self.loss_row_mask.unsqueeze(-1)

    @property
    def num_sequences(self) -> int:
        """B, the number of rows."""
        return int(self.input_ids.shape[0])

    def select(self, rows: slice | torch.Tensor) -> TrainBatch:
        """Rows ``rows`` of every tensor (used to cut micro-batches; per-token weights travel with their rows)."""

        def take(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[rows]

        return TrainBatch(
            input_ids=self.input_ids[rows],
            attention_mask=self.attention_mask[rows],
            response_mask=self.response_mask[rows],
            old_logprobs=take(self.old_logprobs),
            advantages=take(self.advantages),
            token_weights=take(self.token_weights),
            ref_logprobs=take(self.ref_logprobs),
            loss_row_mask=take(self.loss_row_mask),
            extras={k: v[rows] for k, v in self.extras.items()},
            keep_mask=take(self.keep_mask),
            seq_entropy=take(self.seq_entropy),
            rollout_logprobs=take(self.rollout_logprobs),
        )
