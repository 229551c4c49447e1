"""Detached per-micro-batch metric SUMS and COUNTS of the policy losses (docs/algorithm.md sections 1, 3, 4).

Every value is an fp32 scalar tensor summed over this micro-batch's response tokens or sequences, so that the
caller can add micro-batches, all-reduce over data-parallel ranks with SUM (``gtpo_megatron.parallel.
reduce_metric_sums``) and only then divide (e.g. ``clip fraction = clipped_tokens / num_tokens``, ``mean entropy
= entropy_sum / num_tokens``, ``filtered fraction = filtered_sequences / num_sequences``). No ``.item()``.

Dimension legend: B sequences, T token columns (response or full-sequence layout, masked by ``response_mask``).
"""

from __future__ import annotations

import torch


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
    entropy_keep_mask: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Metric sums of one micro-batch.

    Args:
        ratio: ``[B, T]`` importance ratio r.
        clipped_mask: ``[B, T]`` bool, True where the clipped branch of the PPO objective was taken.
        advantages: ``[B]`` advantages used by the loss.
        token_weights: ``[B, T]`` conflict/filter weights (lambda * delta).
        response_mask: ``[B, T]`` bool, True on response tokens.
        kl: optional ``[B, T]`` per-token KL estimate.
        entropy: optional ``[B, T]`` token entropy in nats.
        entropy_keep_mask: optional ``[B]`` bool filter decisions (True = kept).

    Returns:
        dict of fp32 scalars: ``num_tokens``, ``num_sequences`` (rows with a response token), ``clipped_tokens``,
        ``positive_tokens`` / ``negative_tokens`` (tokens of rows with A > 0 / A < 0), ``amplified_tokens``
        (weight > 1: positive conflict tokens), ``zero_weight_tokens`` (weight == 0: negative conflict tokens and
        filtered rows), ``zero_weight_sequences``, ``ratio_sum``, ``kl_sum`` (0 without KL); with ``entropy``:
        ``entropy_sum``; with ``entropy_keep_mask``: ``filtered_sequences`` and ``negative_conflict_tokens``
        (zero-weight tokens of kept rows).
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
    if entropy_keep_mask is not None:
        kept_B = entropy_keep_mask.bool()
        metrics["filtered_sequences"] = _count(has_tokens_B & ~kept_B)
        metrics["negative_conflict_tokens"] = _count(zero_BT & kept_B.unsqueeze(-1))
    return metrics
