"""Detached metric SUMS and COUNTS of the policy loss, and the one table that turns them into means.

Every value is an fp32 scalar tensor summed over this micro-batch's response tokens or sequences, so that callers
add micro-batches, all-reduce over data-parallel ranks with SUM (``parallel.reduce_metric_sums``) and only then
divide by the count :data:`MEANS` names (e.g. ``clip_frac = clipped_tokens / num_tokens``). No ``.item()``.
Dimension legend: B sequences, T token columns (response or full-sequence layout, masked by ``response_mask``).
"""

from __future__ import annotations

import torch

MEANS: dict[str, tuple[str, str]] = {  # mean: (sum, count) among the metric sums
    "clip_frac": ("clipped_tokens", "num_tokens"),
    "ratio_mean": ("ratio_sum", "num_tokens"),
    "kl_mean": ("kl_sum", "num_tokens"),
    "entropy_mean": ("entropy_sum", "num_tokens"),
    "amplified_frac": ("amplified_tokens", "num_tokens"),
    "zero_weight_frac": ("zero_weight_tokens", "num_tokens"),
    "completion_entropy_mean": ("seq_entropy_sum", "num_sequences"),
    "filtered_frac": ("filtered_sequences", "num_sequences"),
    "advantage_abs_mean": ("advantage_abs_sum", "num_sequences"),
    "mismatch_abs_logprob_diff": ("mismatch_abs_logprob_diff", "num_tokens"),
    "mismatch_prob_ratio_err": ("mismatch_prob_ratio_err", "num_tokens"),
    "is_weight_mean": ("is_weight_sum", "num_tokens"),
    "is_capped_frac": ("is_capped_tokens", "num_tokens"),
    "is_undefined_frac": ("is_undefined_tokens", "num_tokens"),
}
"""Entropies in nats (token entropy at the entropy temperature); the mismatch is |log pi_train - log pi_rollout| and
|pi_train / pi_rollout - 1| per response token, before the update; the off-policy weight w and the fractions of
tokens whose pi_prox / mu exceeds the cap or is undefined (NaN; docs/algorithm.md section 11)."""


def means(sums: dict[str, float], names) -> dict[str, float]:
    """``{name: sum / count}`` of the :data:`MEANS` ``names`` whose sum and count are in ``sums`` (count 0 gives 0)."""
    out = {}
    for name in names:
        total, count = MEANS[name]
        if total in sums and count in sums:
            out[name] = sums[total] / max(sums[count], 1.0)
    return out


def _count(values: torch.Tensor) -> torch.Tensor:
    return values.sum(dtype=torch.float32)


def _masked_sum(values: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    return torch.where(mask_BT, values.detach().float(), 0.0).sum()


@torch.no_grad()
def policy_loss_metrics(
    *,
    ratio: torch.Tensor,
    clipped_mask: torch.Tensor,
    advantages: torch.Tensor,
    token_weights: torch.Tensor,
    response_mask: torch.Tensor,
    kl: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    keep_mask: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Metric sums of one micro-batch.

    ``ratio``, ``clipped_mask`` (clipped branch taken), ``token_weights``, ``response_mask``, ``kl`` and ``entropy``
    are ``[B, T]``; ``advantages`` and ``keep_mask`` (delta_i) ``[B]``. Keys: ``num_tokens``,
    ``num_sequences`` (rows with a response token), ``clipped_tokens``, ``positive_tokens`` / ``negative_tokens``
    (rows with A > 0 / A < 0), ``amplified_tokens`` (weight > 1), ``zero_weight_tokens``,
    ``zero_weight_sequences``, ``ratio_sum``, ``kl_sum`` (0 without KL); with ``entropy``: ``entropy_sum``; with
    ``keep_mask``: ``filtered_sequences`` and ``negative_conflict_tokens`` (zero-weight tokens of kept rows).
    """
    mask_BT = response_mask
    has_tokens_B = mask_BT.any(dim=-1)
    zero_BT = mask_BT & (token_weights == 0)
    metrics = {
        "num_tokens": _count(mask_BT),
        "num_sequences": _count(has_tokens_B),
        "clipped_tokens": _count(mask_BT & clipped_mask),
        "positive_tokens": _count(mask_BT & (advantages > 0).unsqueeze(-1)),
        "negative_tokens": _count(mask_BT & (advantages < 0).unsqueeze(-1)),
        "amplified_tokens": _count(mask_BT & (token_weights > 1)),
        "zero_weight_tokens": _count(zero_BT),
        "zero_weight_sequences": _count(has_tokens_B & (zero_BT.sum(dim=-1) == mask_BT.sum(dim=-1))),
        "ratio_sum": _masked_sum(ratio, mask_BT),
        "kl_sum": torch.zeros((), device=mask_BT.device) if kl is None else _masked_sum(kl, mask_BT),
    }
    if entropy is not None:
        metrics["entropy_sum"] = _masked_sum(entropy, mask_BT)
    if keep_mask is not None:
        kept_B = keep_mask.bool()
        metrics["filtered_sequences"] = _count(has_tokens_B & ~kept_B)
        metrics["negative_conflict_tokens"] = _count(zero_BT & kept_B.unsqueeze(-1))
    return metrics


@torch.no_grad()
def mismatch_sums(
    train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Train/rollout mismatch sums over response tokens (all inputs ``[B, T]``; log-probs in nats).

    ``mismatch_abs_logprob_diff``: sum of |log pi_train - log pi_rollout|; ``mismatch_prob_ratio_err``: sum of
    |pi_train / pi_rollout - 1|. Divide by ``num_tokens`` after reducing.
    """
    delta = torch.where(response_mask, train_logprobs.float() - rollout_logprobs.float(), 0.0)
    ratio_err = torch.where(response_mask, torch.expm1(delta).abs(), 0.0)
    return {"mismatch_abs_logprob_diff": delta.abs().sum(), "mismatch_prob_ratio_err": ratio_err.sum()}
