"""The step objective of one micro-batch from its own tokens: delta_i, ``A_i - gamma <H>_i`` and the loss.

docs/algorithm.md sections 1 and 4. A completion's mean entropy ``<H>_i``, its filter decision ``delta_i`` and its
penalised advantage ``A_i - gamma <H>_i`` depend only on that completion's own tokens (given ``<H>_ini``, a scalar
known before the step), so with one update per batch they are computed here, in the training forward, from the
entropy the vocab-parallel log-prob op returns together with the log-probs (one read of the logits; entropy
detached): no forward pass before the update is needed. :func:`policy_objective` is the whole per-micro-batch
objective (the piece an external Megatron pipeline calls from its loss function); :func:`sequence_terms` is its
per-completion part, also used on the whole batch when a caller measured the entropies in a separate pass.

Normaliser: ``normalizer`` is computed by the caller from ``response_mask`` only (``losses.compute_normalizer``,
summed over the step), so it counts filtered completions too: the ``1/G`` of docs/algorithm.md section 1 runs over all
completions of the group, and a filtered one contributes 0 to the sum, not to the count.

Dimension legend: P prompts, G group size, B = P*G sequences (or this micro-batch's rows), T token columns
(response layout or the full ``[B, S]`` layout; everything is masked by ``response_mask``).
Pure torch: no collectives, no ``.item()``, inputs never modified.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gtpo_megatron.ops.entropy_filter import apply_entropy_penalty, entropy_keep_mask, sequence_mean_entropy
from gtpo_megatron.ops.losses import LossSpec, get_policy_loss


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

    Args:
        seq_entropy: ``[B]`` mean entropy ``<H>_i`` in nats (``entropy_filter.sequence_mean_entropy``).
        raw_advantages: ``[B]`` group-relative advantages ``A_i`` (section 2), before the penalty.
        spec: the step objective (``entropy_filter``, ``entropy_threshold``, ``initial_entropy``,
            ``entropy_only_negative``, ``entropy_penalty``).
        keep_mask: optional ``[B]`` bool decided without the entropy (e.g. ``skip_uniform_groups``); ANDed in.

    Returns:
        :class:`SequenceTerms`.

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
    *,
    policy_logprobs: torch.Tensor,
    entropy: torch.Tensor | None,
    raw_advantages: torch.Tensor,
    token_weights: torch.Tensor,
    response_mask: torch.Tensor,
    normalizer: torch.Tensor,
    spec: LossSpec,
    keep_mask: torch.Tensor | None = None,
    seq_entropy: torch.Tensor | None = None,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], SequenceTerms]:
    """This micro-batch's contribution to the step objective, with delta_i and ``A_i - gamma <H>_i`` decided here.

    Args:
        policy_logprobs: ``[B, T]`` fp32 log pi_theta at ``spec.temperature`` (nats), differentiable.
        entropy: ``[B, T]`` fp32 token entropy at ``spec.entropy_temperature`` (nats; detached, e.g. the second
            output of ``vocab_parallel_logprobs_entropy(..., entropy_temperature=...)``); values off
            ``response_mask`` are ignored. None only when ``seq_entropy`` is given or ``spec`` neither filters
            nor penalises (then no entropy metrics).
        raw_advantages: ``[B]`` group-relative advantages ``A_i`` (docs/algorithm.md section 2, before the penalty).
        token_weights: ``[B, T]`` per-token multiplier decided before the forward: conflict lambda (section 3)
            times any row decision independent of the entropy (e.g. DAPO's overlong filter); ``delta_i`` is
            applied here. Baselines pass ``response_mask.float()``.
        response_mask: ``[B, T]`` bool, True on response tokens.
        normalizer: scalar tensor (> 0), the step's global count (``losses.compute_normalizer`` over the step's
            masks; independent of ``delta_i``, see the module docstring).
        spec: the step objective (:class:`~gtpo_megatron.ops.losses.LossSpec`).
        keep_mask: optional ``[B]`` bool row decision made without the entropy (``skip_uniform_groups``); it
            counts as filtered in the metrics.
        seq_entropy: optional ``[B]`` ``<H>_i`` measured beforehand (a separate pass at the old weights, when one
            is needed); None: from ``entropy``.
        old_logprobs: ``[B, T]`` log pi_old (several updates per batch) or None (ratio 1 with gradient).
        ref_logprobs: ``[B, T]`` reference-policy log-probs for the KL term (``spec.kl_coef > 0``), or None.

    Returns:
        ``(loss, metrics, terms)``: the fp32 scalar loss (gradient w.r.t. ``policy_logprobs`` only); the loss's
        metric sums (``loss_metrics.policy_loss_metrics``, with ``entropy_sum`` of ``entropy`` and
        ``filtered_sequences`` of ``terms.keep_mask``) plus ``advantage_abs_sum`` and (given an entropy)
        ``seq_entropy_sum`` over the rows with a response token; and the :class:`SequenceTerms`.

    Raises:
        ValueError: neither ``entropy`` nor ``seq_entropy`` while ``spec`` filters or penalises, and the checks of
            :func:`sequence_terms` and of the registered loss.
    """
    measured = seq_entropy is not None or entropy is not None
    if seq_entropy is None:
        seq_entropy = _seq_entropy(entropy, response_mask, spec)
    terms = sequence_terms(seq_entropy, raw_advantages, spec, keep_mask=keep_mask)
    loss, metrics = get_policy_loss(spec.loss_name)(
        policy_logprobs=policy_logprobs,
        old_logprobs=old_logprobs,
        advantages=terms.advantages,
        token_weights=token_weights * terms.keep_mask.unsqueeze(-1),
        response_mask=response_mask,
        normalizer=normalizer,
        aggregation=spec.aggregation,
        clip_eps_low=spec.clip_eps_low,
        clip_eps_high=spec.clip_eps_high,
        ref_logprobs=ref_logprobs,
        kl_coef=spec.kl_coef,
        kl_estimator=spec.kl_estimator,
        entropy=entropy,
        entropy_keep_mask=terms.keep_mask,
    )
    has_tokens_B = response_mask.any(dim=-1)
    if measured:
        metrics["seq_entropy_sum"] = torch.where(has_tokens_B, terms.seq_entropy, 0.0).sum()
    metrics["advantage_abs_sum"] = torch.where(has_tokens_B, terms.advantages.abs(), 0.0).sum()
    return loss, metrics, terms


def _seq_entropy(entropy: torch.Tensor | None, response_mask: torch.Tensor, spec: LossSpec) -> torch.Tensor:
    """``[B]`` <H>_i of ``entropy``; zeros when there is none and ``spec`` does not read it."""
    if entropy is not None:
        return sequence_mean_entropy(entropy, response_mask)
    if spec.entropy_filter != "off" or spec.entropy_penalty > 0:
        raise ValueError(
            f"entropy_filter={spec.entropy_filter!r} / entropy_penalty={spec.entropy_penalty} need each completion's "
            "entropy: pass entropy [B, T] (vocab_parallel_logprobs_entropy's second output) or seq_entropy [B]"
        )
    return torch.zeros(response_mask.shape[0], dtype=torch.float32, device=response_mask.device)
