"""One step's GTPO weights (advantages, the entropy filter, conflict weights) and the step objective's spec.

GTPO_SPEC sections 2-4 composed from ``ops`` (the math) on the whole step batch: lambda and delta are computed on
complete groups before the batch is split over data-parallel ranks (section 8). Pure functions of tensors and the
algorithm section (no collectives, no I/O), called by ``trainer.py``.

Dimension legend: P prompts, G group size, B = P*G rows laid out group by group, S padded prompt+response length.
Per-token tensors use the ``TrainBatch`` layout: column ``s`` describes the prediction of ``input_ids[:, s]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gtpo_megatron.config import AlgorithmConfig, RolloutConfig
from gtpo_megatron.data.sampling import filter_uniform_groups
from gtpo_megatron.ops import (
    LossSpec,
    apply_entropy_penalty,
    build_conflict_weights,
    compute_group_advantages,
    conflict_normalizers,
    entropy_keep_mask,
)
from gtpo_megatron.rollout.types import TrainBatch


@dataclass
class StepWeights:
    """Per-sequence and per-token quantities of one step's full batch.

    Attributes:
        raw_advantages: ``[B]`` fp32 group-relative advantages A_i (GTPO_SPEC section 2).
        advantages: ``[B]`` fp32 advantages used by the loss (A_i - gamma <H>_i, section 4).
        keep_mask: ``[B]`` bool delta_i of the entropy filter (True = completion enters the loss; a dropped one
            still counts in the loss normaliser, GTPO_SPEC section 1).
        conflict_weights: ``[B, S]`` fp32 lambda before the filter (section 3), 0 off the response.
        token_weights: ``[B, S]`` fp32 lambda * delta_i * loss_row_mask, 0 off the response.
        loss_row_mask: ``[B]`` bool, False on rows removed from the objective (``skip_uniform_groups``,
            ``overlong_filter``): weight 0 and no count in the loss normaliser (``ops.compute_normalizer``).
    """

    raw_advantages: torch.Tensor
    advantages: torch.Tensor
    keep_mask: torch.Tensor
    conflict_weights: torch.Tensor
    token_weights: torch.Tensor
    loss_row_mask: torch.Tensor


def compute_step_weights(
    batch: TrainBatch,
    rewards: torch.Tensor,
    seq_entropy: torch.Tensor,
    cfg: AlgorithmConfig,
    *,
    initial_entropy: float | None,
) -> StepWeights:
    """:func:`compute_weights` of a ``TrainBatch`` (its ``input_ids``, ``response_mask`` and ``truncated`` extra).

    Args:
        batch: the full (unsharded) step batch from ``collate_completions``.
        rewards: ``[B]`` shaped rewards.
        seq_entropy: ``[B]`` per-completion mean entropy <H>_i in nats (global, gathered over data-parallel ranks).
        cfg: algorithm section.
        initial_entropy: <H>_ini for the ``paper`` filter (None for the other modes).
    """
    return compute_weights(
        batch.input_ids,
        batch.response_mask,
        rewards,
        seq_entropy,
        cfg,
        initial_entropy=initial_entropy,
        truncated=batch.extras.get("truncated"),
    )


def compute_weights(
    input_ids: torch.Tensor,
    response_mask: torch.Tensor,
    rewards: torch.Tensor,
    seq_entropy: torch.Tensor,
    cfg: AlgorithmConfig,
    *,
    initial_entropy: float | None,
    truncated: torch.Tensor | None = None,
) -> StepWeights:
    """Advantages, the entropy filter and conflict weights of a whole step (GTPO_SPEC sections 2-4).

    Args:
        input_ids: ``[B, S]`` int token ids, rows group by group (``cfg.group_size`` consecutive rows per prompt);
            only the columns where ``response_mask`` is True are read (any padding side, any pad id).
        response_mask: ``[B, S]`` bool, True on response tokens.
        rewards: ``[B]`` rewards.
        seq_entropy: ``[B]`` per-completion mean entropy <H>_i in nats.
        cfg: algorithm section.
        initial_entropy: <H>_ini for the ``paper`` filter (None for the other modes).
        truncated: ``[B]`` bool, completions cut at the token limit; required by ``cfg.overlong_filter``.

    Raises:
        ValueError: ``cfg.overlong_filter`` without ``truncated``, and the checks of the ``ops`` functions.
    """
    if cfg.overlong_filter and truncated is None:
        raise ValueError(
            "algorithm.overlong_filter=true needs truncated ([B] bool: finish_reason == 'length'); pass it or "
            "set algorithm.overlong_filter=false"
        )
    group_size = cfg.group_size
    raw_B = compute_group_advantages(rewards, group_size, estimator=cfg.advantage_estimator)
    keep_B = entropy_keep_mask(
        seq_entropy,
        mode=cfg.entropy_filter,
        threshold=cfg.entropy_threshold,
        initial_entropy=initial_entropy,
        advantages=raw_B,
        only_negative=cfg.entropy_only_negative,
    )
    conflict_adv_B = raw_B * keep_B if cfg.exclude_filtered_from_conflicts else raw_B
    if cfg.conflict_mode == "off":
        lambda_BS = response_mask.float()
    else:
        lambda_BS = build_conflict_weights(
            input_ids,
            response_mask,
            conflict_adv_B,
            group_size,
            amplification=cfg.conflict_amplification,
            mode=cfg.conflict_mode,
            overlap=cfg.conflict_overlap,
        )
        if cfg.normalize_by_conflicts:
            lambda_BS = lambda_BS / conflict_normalizers(
                input_ids, response_mask, conflict_adv_B, group_size, mode=cfg.conflict_mode
            ).unsqueeze(-1)
    loss_row_B = build_loss_row_mask(rewards, cfg, truncated=truncated)
    advantages_B = apply_entropy_penalty(raw_B, seq_entropy, cfg.entropy_penalty)
    return StepWeights(
        raw_advantages=raw_B,
        advantages=advantages_B,
        keep_mask=keep_B,
        conflict_weights=lambda_BS,
        token_weights=lambda_BS * (keep_B & loss_row_B).unsqueeze(-1),
        loss_row_mask=loss_row_B,
    )


def build_loss_row_mask(
    rewards: torch.Tensor, cfg: AlgorithmConfig, *, truncated: torch.Tensor | None = None
) -> torch.Tensor:
    """``[B]`` bool, False on rows the switches remove from the objective (loss and normaliser), True elsewhere.

    ``skip_uniform_groups`` removes every row of a group whose rewards are all equal (GTPO_SPEC section 4; the one
    rule of ``data.sampling.filter_uniform_groups``); ``overlong_filter`` removes the rows where ``truncated``
    (``[B]`` bool) is True (DAPO, section 5); :func:`compute_weights` checks that it is given.
    """
    keep_B = torch.ones(rewards.shape[0], dtype=torch.bool, device=rewards.device)
    if cfg.skip_uniform_groups:
        keep_B &= filter_uniform_groups(rewards, cfg.group_size).repeat_interleave(cfg.group_size)
    if cfg.overlong_filter:
        keep_B &= ~truncated
    return keep_B


def weight_metrics(weights: StepWeights, response_mask: torch.Tensor) -> dict[str, float]:
    """Filter and conflict fractions of the full batch.

    ``gtpo/conflict_frac_pos``: response tokens of A > 0 completions whose lambda differs from 1 (amplified);
    ``gtpo/conflict_frac_neg``: response tokens of A < 0 completions with lambda = 0; both over all response
    tokens, and ``gtpo/conflict_frac`` is their sum. ``gtpo/filtered_frac``: completions with delta = 0 (entropy
    filter); ``gtpo/removed_frac``: completions removed by ``skip_uniform_groups`` / ``overlong_filter``.
    """
    num_tokens = response_mask.sum().clamp(min=1).float()
    lam = weights.conflict_weights
    pos = response_mask & (weights.raw_advantages > 0).unsqueeze(-1) & (lam != 1)
    neg = response_mask & (weights.raw_advantages < 0).unsqueeze(-1) & (lam == 0)
    frac_pos, frac_neg = float(pos.sum() / num_tokens), float(neg.sum() / num_tokens)
    return {
        "gtpo/filtered_frac": float((~weights.keep_mask).float().mean()),
        "gtpo/removed_frac": float((~weights.loss_row_mask).float().mean()),
        "gtpo/conflict_frac": frac_pos + frac_neg,
        "gtpo/conflict_frac_pos": frac_pos,
        "gtpo/conflict_frac_neg": frac_neg,
        "advantage/abs_mean": float(weights.advantages.abs().mean()),
    }


def build_loss_spec(algorithm: AlgorithmConfig, rollout: RolloutConfig) -> LossSpec:
    """The step objective of ``algorithm`` (GTPO_SPEC sections 1 and 5) as the policy receives it.

    The log-probs are taken at the sampling temperature (``rollout.temperature``), so pi_theta is the distribution
    the completions were drawn from; Dr. GRPO's constant normaliser uses L = ``rollout.max_tokens``.
    """
    return LossSpec(
        loss_name=algorithm.name,
        aggregation=algorithm.aggregation,
        clip_eps_low=algorithm.clip_eps_low,
        clip_eps_high=algorithm.clip_eps_high,
        kl_coef=algorithm.kl_coef,
        kl_estimator=algorithm.kl_estimator,
        temperature=rollout.temperature,
        max_response_length=rollout.max_tokens if algorithm.name == "dr_grpo" else None,
    )
