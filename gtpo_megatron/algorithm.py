"""One step's GTPO weights (advantages, conflict weights), the step objective's spec and the step's pass structure.

docs/algorithm.md sections 2-4 composed from ``ops`` on complete groups, before the batch is split over DP ranks
(section 8); the entropy terms are left to ``ops.policy_objective`` in the training forward unless
:func:`needs_old_logprob_pass`. Pure functions (no collectives, no I/O). B = P*G rows group by group, S padded
length, per-token tensors in ``TrainBatch`` columns.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from gtpo_megatron.batch import TrainBatch
from gtpo_megatron.config import AlgorithmConfig, RolloutConfig
from gtpo_megatron.data.dynamic_sampling import filter_uniform_groups
from gtpo_megatron.ops import (
    LossSpec,
    build_conflict_weights,
    compute_group_advantages,
    conflict_normalizers,
    means,
    sequence_terms,
)


@dataclass
class StepWeights:
    """Per-sequence and per-token quantities of one step's full batch, decided before the training forward.

    Attributes:
        raw_advantages: ``[B]`` fp32 A_i (section 2), before the entropy penalty.
        conflict_weights: ``[B, S]`` fp32 lambda (section 3) before normalisation, 0 off the response.
        token_weights: ``[B, S]`` fp32 the loss's multiplier (lambda, normalised if configured, 0 on removed rows).
        loss_row_mask: ``[B]`` bool, the rows in the objective.
        advantages, keep_mask: None, or after :func:`with_entropy_terms` ``[B]`` ``A_i - gamma <H>_i`` and delta_i.
    """

    raw_advantages: torch.Tensor
    conflict_weights: torch.Tensor
    token_weights: torch.Tensor
    loss_row_mask: torch.Tensor
    advantages: torch.Tensor | None = None
    keep_mask: torch.Tensor | None = None


def conflicts_need_entropy(cfg: AlgorithmConfig) -> bool:
    """Whether lambda depends on the entropies (``penalized`` sign with gamma > 0, or excluding filtered rows)."""
    if cfg.conflict_mode == "off":
        return False
    penalized = cfg.conflict_sign == "penalized" and cfg.entropy_penalty > 0
    return penalized or (cfg.exclude_filtered_from_conflicts and cfg.entropy_filter != "off")


def needs_old_logprob_pass(cfg: AlgorithmConfig, *, initial_entropy_known: bool) -> bool:
    """Whether a step needs a no-grad pass before its update (docs/algorithm.md sections 1 and 4).

    Only for ``num_updates_per_batch > 1``, while the ``paper`` filter measures <H>_ini, or when
    :func:`conflicts_need_entropy`.
    """
    measuring = cfg.entropy_filter == "paper" and not initial_entropy_known
    return cfg.num_updates_per_batch > 1 or measuring or conflicts_need_entropy(cfg)


def compute_step_weights(
    batch: TrainBatch,
    rewards: torch.Tensor,
    cfg: AlgorithmConfig,
    *,
    loss_spec: LossSpec,
    seq_entropy: torch.Tensor | None = None,
    scores: torch.Tensor | None = None,
) -> StepWeights:
    """:func:`compute_weights` of the full step ``TrainBatch`` (``[B]`` shaped ``rewards``, task ``scores``)."""
    return compute_weights(
        batch.input_ids,
        batch.response_mask,
        rewards,
        cfg,
        loss_spec=loss_spec,
        seq_entropy=seq_entropy,
        truncated=batch.truncated,
        scores=scores,
    )


def compute_weights(
    input_ids: torch.Tensor,
    response_mask: torch.Tensor,
    rewards: torch.Tensor,
    cfg: AlgorithmConfig,
    *,
    loss_spec: LossSpec,
    seq_entropy: torch.Tensor | None = None,
    truncated: torch.Tensor | None = None,
    scores: torch.Tensor | None = None,
) -> StepWeights:
    """Advantages, ``loss_row_mask`` and conflict weights of a whole step (docs/algorithm.md sections 2-4).

    ``input_ids`` / ``response_mask`` ``[B, S]``, ``rewards`` / ``truncated`` / ``scores`` (None: rewards) ``[B]``;
    ``loss_spec`` and ``seq_entropy`` (``[B]`` <H>_i) are read only when lambda needs the entropies.

    Raises:
        ValueError: ``cfg.overlong_filter`` without ``truncated``; lambda needs the entropies
            (:func:`conflicts_need_entropy`) and ``seq_entropy`` is None; the checks of the ``ops`` functions.
    """
    if cfg.overlong_filter and truncated is None:
        raise ValueError(
            "algorithm.overlong_filter=true needs truncated ([B] bool: finish_reason == 'length'); pass it or "
            "set algorithm.overlong_filter=false"
        )
    group_size = cfg.group_size
    raw_B = compute_group_advantages(rewards, group_size, estimator=cfg.advantage_estimator)
    loss_row_B = build_loss_row_mask(rewards if scores is None else scores, cfg, truncated=truncated)
    if cfg.conflict_mode == "off":
        lambda_BS = weights_BS = response_mask.float()
    else:
        sign_B = _conflict_sign_advantages(raw_B, loss_row_B, cfg, loss_spec, seq_entropy)
        lambda_BS = build_conflict_weights(
            input_ids,
            response_mask,
            sign_B,
            group_size,
            amplification=cfg.conflict_amplification,
            mode=cfg.conflict_mode,
            overlap=cfg.conflict_overlap,
        )
        weights_BS = lambda_BS
        if cfg.normalize_by_conflicts:
            counts_B = conflict_normalizers(input_ids, response_mask, sign_B, group_size, mode=cfg.conflict_mode)
            weights_BS = lambda_BS / counts_B.unsqueeze(-1)
    return StepWeights(
        raw_advantages=raw_B,
        conflict_weights=lambda_BS,
        token_weights=weights_BS * loss_row_B.unsqueeze(-1),
        loss_row_mask=loss_row_B,
    )


def build_loss_row_mask(
    scores: torch.Tensor, cfg: AlgorithmConfig, *, truncated: torch.Tensor | None = None
) -> torch.Tensor:
    """``[B]`` bool, False on rows the switches remove from the objective (loss and normaliser), True elsewhere.

    ``skip_uniform_groups``: groups whose task ``scores`` are all equal (section 4); ``overlong_filter``: rows
    where ``truncated`` ``[B]`` is True (section 5).
    """
    keep_B = torch.ones(scores.shape[0], dtype=torch.bool, device=scores.device)
    if cfg.skip_uniform_groups:
        keep_B &= filter_uniform_groups(scores, cfg.group_size).repeat_interleave(cfg.group_size)
    if cfg.overlong_filter:
        keep_B &= ~truncated.bool()
    return keep_B


def with_entropy_terms(weights: StepWeights, seq_entropy: torch.Tensor, loss_spec: LossSpec) -> StepWeights:
    """``weights`` with the entropy terms of known ``seq_entropy`` (``[B]`` nats), for a loss without them.

    Pair it with a spec whose filter is off and penalty 0 (``loss_forms.forward_settings``), or they apply twice.
    """
    terms = sequence_terms(seq_entropy, weights.raw_advantages, loss_spec, keep_mask=weights.loss_row_mask)
    return dataclasses.replace(
        weights,
        advantages=terms.advantages,
        keep_mask=terms.keep_mask,
        token_weights=weights.token_weights * terms.keep_mask.unsqueeze(-1),
    )


def _conflict_sign_advantages(
    raw_B: torch.Tensor,
    keep_B: torch.Tensor,
    cfg: AlgorithmConfig,
    loss_spec: LossSpec,
    seq_entropy: torch.Tensor | None,
) -> torch.Tensor:
    """The ``[B]`` advantages whose sign splits each group into P+ and P- (section 3; 0 = in neither)."""
    sign_B = raw_B
    if conflicts_need_entropy(cfg):
        if seq_entropy is None:
            raise ValueError(
                f"algorithm.conflict_sign={cfg.conflict_sign!r} / exclude_filtered_from_conflicts="
                f"{cfg.exclude_filtered_from_conflicts}: the conflict weights need every completion's <H>_i before "
                "the update; run the no-grad pass first (algorithm.needs_old_logprob_pass) and pass seq_entropy"
            )
        terms = sequence_terms(seq_entropy, raw_B, loss_spec, keep_mask=keep_B)
        if cfg.conflict_sign == "penalized":
            sign_B = terms.advantages
        keep_B = terms.keep_mask
    return sign_B * keep_B if cfg.exclude_filtered_from_conflicts else sign_B


def conflict_metrics(weights: StepWeights, response_mask: torch.Tensor) -> dict[str, float]:
    """Conflict fractions of the full batch, from the un-normalised lambda (section 3).

    ``_pos``: tokens of A > 0 rows with lambda > 1, ``_neg``: of A < 0 rows with lambda = 0, over all response
    tokens; ``gtpo/removed_frac``: rows with ``loss_row_mask`` False (docs/metrics.md).
    """
    num_tokens = response_mask.sum().clamp(min=1).float()
    lam = weights.conflict_weights
    pos = response_mask & (weights.raw_advantages > 0).unsqueeze(-1) & (lam > 1)
    neg = response_mask & (weights.raw_advantages < 0).unsqueeze(-1) & (lam == 0)
    frac_pos, frac_neg = float(pos.sum() / num_tokens), float(neg.sum() / num_tokens)
    return {
        "gtpo/removed_frac": float((~weights.loss_row_mask).float().mean()),
        "gtpo/conflict_frac": frac_pos + frac_neg,
        "gtpo/conflict_frac_pos": frac_pos,
        "gtpo/conflict_frac_neg": frac_neg,
    }


OBJECTIVE_METRICS = {  # step metric: its ops.MEANS row, over the training forward's sums (reduced over dp)
    "entropy/completion_mean": "completion_entropy_mean",
    "entropy/token_mean": "entropy_mean",
    "gtpo/filtered_frac": "filtered_frac",
    "advantage/abs_mean": "advantage_abs_mean",
    "mismatch/abs_logprob_diff": "mismatch_abs_logprob_diff",
    "mismatch/prob_ratio_err": "mismatch_prob_ratio_err",
    "offpolicy/is_weight_mean": "is_weight_mean",
    "offpolicy/is_capped_frac": "is_capped_frac",
    "offpolicy/is_undefined_frac": "is_undefined_frac",
}


def objective_metrics(train_metrics: dict[str, float]) -> dict[str, float]:
    """The :data:`OBJECTIVE_METRICS` whose sums are in ``train_metrics`` (a count of 0 gives 0)."""
    found = means(train_metrics, OBJECTIVE_METRICS.values())
    return {name: found[row] for name, row in OBJECTIVE_METRICS.items() if row in found}


def loss_temperature(algorithm: AlgorithmConfig, rollout: RolloutConfig) -> float:
    """The log-prob temperature of the loss: ``rollout.temperature`` for ``loss_temperature: sampling``, else 1."""
    return rollout.temperature if algorithm.loss_temperature == "sampling" else float(algorithm.loss_temperature)


def build_loss_spec(algorithm: AlgorithmConfig, rollout: RolloutConfig) -> LossSpec:
    """The step objective of ``algorithm`` (docs/algorithm.md sections 1, 4, 5 and 11) as the policy receives it.

    ``initial_entropy`` stays None until measured; Dr. GRPO's L is ``rollout.max_tokens``.
    """
    return LossSpec(
        loss_name=algorithm.name,
        aggregation=algorithm.aggregation,
        clip_eps_low=algorithm.clip_eps_low,
        clip_eps_high=algorithm.clip_eps_high,
        kl_coef=algorithm.kl_coef,
        kl_estimator=algorithm.kl_estimator,
        temperature=loss_temperature(algorithm, rollout),
        max_response_length=rollout.max_tokens if algorithm.name == "dr_grpo" else None,
        entropy_temperature=algorithm.entropy_temperature,
        entropy_filter=algorithm.entropy_filter,
        entropy_threshold=algorithm.entropy_threshold,
        entropy_only_negative=algorithm.entropy_only_negative,
        entropy_penalty=algorithm.entropy_penalty,
        off_policy_correction=algorithm.off_policy_correction,
        off_policy_cap=algorithm.off_policy_cap,
    )
