"""The step objective of one micro-batch from its own tokens: delta_i, ``A_i - gamma <H>_i`` and the loss.

docs/algorithm.md sections 1 and 4: ``<H>_i``, delta_i and ``A_i - gamma <H>_i`` depend only on the completion's
own tokens (given ``<H>_ini``), so they are computed in the training forward from the entropy the log-prob op
returns with the log-probs. :func:`sequence_terms` is the per-completion part, also used on a whole batch whose
entropies a separate pass measured. B rows, T columns. Pure torch: no collectives, no ``.item()``, inputs never
modified.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from gtpo_megatron.ops.entropy_filter import apply_entropy_penalty, entropy_keep_mask, sequence_mean_entropy
from gtpo_megatron.ops.loss_metrics import mismatch_sums
from gtpo_megatron.ops.losses import LossSpec, policy_loss
from gtpo_megatron.ops.off_policy import ImportanceWeights, importance_weights

if TYPE_CHECKING:
    from gtpo_megatron.batch import TrainBatch


@dataclass(frozen=True)
class SequenceTerms:
    """Per-completion terms of docs/algorithm.md section 4.

    Attributes:
        seq_entropy: ``[B]`` fp32 mean token entropy ``<H>_i`` in nats (detached), at ``spec.entropy_temperature``.
        keep_mask: ``[B]`` bool, delta_i and the caller's ``keep_mask`` (True = the completion enters the loss).
        advantages: ``[B]`` fp32 ``A_i - gamma <H>_i`` (every row, kept or not).
    """

    seq_entropy: torch.Tensor
    keep_mask: torch.Tensor
    advantages: torch.Tensor


def sequence_terms(
    seq_entropy: torch.Tensor,
    raw_advantages: torch.Tensor,
    spec: LossSpec,
    *,
    keep_mask: torch.Tensor | None = None,
) -> SequenceTerms:
    """delta_i and the penalised advantage of each completion (docs/algorithm.md section 4).

    ``seq_entropy`` ``[B]`` nats, ``raw_advantages`` ``[B]``; ``keep_mask`` ``[B]`` bool is ANDed into delta_i.

    Raises:
        ValueError: from ``entropy_keep_mask`` / ``apply_entropy_penalty`` (e.g. the ``paper`` filter without
            ``spec.initial_entropy``, shape mismatches).
    """
    seq_entropy = seq_entropy.detach().float()
    keep_B = entropy_keep_mask(
        seq_entropy,
        mode=spec.entropy_filter,
        threshold=spec.entropy_threshold,
        initial_entropy=spec.initial_entropy,
        advantages=raw_advantages,
        only_negative=spec.entropy_only_negative,
    )
    if keep_mask is not None:
        keep_B = keep_B & keep_mask.bool()
    advantages_B = apply_entropy_penalty(raw_advantages, seq_entropy, spec.entropy_penalty)
    return SequenceTerms(seq_entropy=seq_entropy, keep_mask=keep_B, advantages=advantages_B)


def policy_objective(
    policy_logprobs: torch.Tensor,
    entropy: torch.Tensor | None,
    batch: TrainBatch,
    spec: LossSpec,
    normalizer: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], SequenceTerms]:
    """This micro-batch's contribution to the step objective, with delta_i and ``A_i - gamma <H>_i`` decided here.

    ``policy_logprobs`` ``[B, T]`` fp32 (differentiable); ``entropy`` ``[B, T]`` detached (None only with
    ``batch.seq_entropy`` or without filter and penalty); ``normalizer`` the step's global count (1: plain sum).

    Returns:
        ``(loss, metrics, terms)``: the fp32 scalar loss; detached sums (``policy_loss_metrics``'s, ``loss``,
        ``advantage_abs_sum``, ``seq_entropy_sum`` given an entropy, ``mismatch_sums`` of the proximal policy
        (``old_logprobs``, else the detached ``policy_logprobs``) given ``rollout_logprobs``, ``is_weight_sum``,
        ``is_capped_tokens`` and ``is_undefined_tokens`` with an off-policy correction (an undefined token's
        surrogate is taken at ratio 1 and weighted 0), ``logprob_diff_max`` given ``old_logprobs``: reduce it with
        MAX); the terms.

    Raises:
        ValueError: ``batch.advantages`` is None; no entropy while ``spec`` filters or penalises; an off-policy
            correction without ``batch.rollout_logprobs``; the checks of :func:`sequence_terms`,
            ``off_policy.importance_weights`` and ``losses.policy_loss``.
    """
    if batch.advantages is None:
        raise ValueError("batch.advantages is None; fill TrainBatch.advantages (the raw A_i) before the loss")
    mask = batch.loss_mask
    token_weights = mask.float() if batch.token_weights is None else batch.token_weights
    measured = batch.seq_entropy is not None or entropy is not None
    seq_entropy = batch.seq_entropy if batch.seq_entropy is not None else _seq_entropy(entropy, mask, spec)
    terms = sequence_terms(seq_entropy, batch.advantages, spec)
    proximal = policy_logprobs.detach() if batch.old_logprobs is None else batch.old_logprobs
    correction = _correction(proximal, batch, spec)
    old_logprobs = batch.old_logprobs
    if correction is not None and old_logprobs is not None:  # an undefined rho's token: ratio 1, weight 0
        old_logprobs = torch.where(correction.undefined_BT, policy_logprobs.detach(), old_logprobs)
    loss, metrics = policy_loss(
        policy_logprobs=policy_logprobs,
        old_logprobs=old_logprobs,
        advantages=terms.advantages,
        token_weights=token_weights * terms.keep_mask.unsqueeze(-1),
        response_mask=mask,
        normalizer=normalizer,
        spec=spec,
        ref_logprobs=batch.ref_logprobs,
        entropy=entropy,
        keep_mask=terms.keep_mask,
        is_weights=None if correction is None else correction.weights_BT,
    )
    if correction is not None:
        metrics["is_weight_sum"] = correction.weights_BT.sum()
        metrics["is_capped_tokens"] = correction.capped_BT.sum(dtype=torch.float32)
        metrics["is_undefined_tokens"] = correction.undefined_BT.sum(dtype=torch.float32)
    has_tokens_B = mask.any(dim=-1)
    if measured:
        metrics["seq_entropy_sum"] = torch.where(has_tokens_B, terms.seq_entropy, 0.0).sum()
    metrics["advantage_abs_sum"] = torch.where(has_tokens_B, terms.advantages.abs(), 0.0).sum()
    metrics["loss"] = loss.detach().float()
    if batch.rollout_logprobs is not None:
        metrics.update(mismatch_sums(proximal, batch.rollout_logprobs, mask))
    if batch.old_logprobs is not None:
        diff = torch.where(mask, (policy_logprobs.detach() - batch.old_logprobs).abs(), 0.0)
        metrics["logprob_diff_max"] = diff.max() if diff.numel() else diff.new_zeros(())
    return loss, metrics, terms


def _correction(proximal_BT: torch.Tensor, batch: TrainBatch, spec: LossSpec) -> ImportanceWeights | None:
    """The off-policy weights of ``spec`` (docs/algorithm.md section 11), None without a correction."""
    if spec.off_policy_correction == "none":
        return None
    if batch.rollout_logprobs is None:
        raise ValueError(
            f"algorithm.off_policy_correction={spec.off_policy_correction!r} needs the behaviour log-probs: set "
            "batch.rollout_logprobs [B, T] to the engine's sampled-token log-probs (vLLM logprobs=0, "
            "processed_logprobs) or set algorithm.off_policy_correction=none"
        )
    return importance_weights(
        proximal_BT,
        batch.rollout_logprobs,
        batch.loss_mask,
        mode=spec.off_policy_correction,
        cap=spec.off_policy_cap,
    )


def _seq_entropy(entropy: torch.Tensor | None, response_mask: torch.Tensor, spec: LossSpec) -> torch.Tensor:
    """``[B]`` <H>_i of ``entropy``; zeros when there is none and ``spec`` does not read it."""
    if entropy is not None:
        return sequence_mean_entropy(entropy, response_mask)
    if spec.entropy_filter != "off" or spec.entropy_penalty > 0:
        raise ValueError(
            f"entropy_filter={spec.entropy_filter!r} / entropy_penalty={spec.entropy_penalty} need each completion's "
            "entropy: pass entropy [B, T] (vocab_parallel_logprobs_entropy's second output) or batch.seq_entropy [B]"
        )
    return torch.zeros(response_mask.shape[0], dtype=torch.float32, device=response_mask.device)
