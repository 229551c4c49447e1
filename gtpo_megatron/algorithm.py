"""One step's GTPO weights (advantages, conflict weights), the step objective's spec and the step's pass structure.

GTPO_SPEC sections 2-4 composed from ``ops`` (the math) on the whole step batch: advantages and lambda are
computed on complete groups before the batch is split over data-parallel ranks (section 8). The per-completion
entropy terms (delta_i and ``A_i - gamma <H>_i``) are decided inside the training forward by
``ops.policy_objective`` from each completion's own tokens; only when lambda itself depends on them (or more than
one update per batch, or while ``<H>_ini`` is measured) does the trainer run a no-grad pass first
(:func:`needs_old_logprob_pass`). Pure functions of tensors and config sections (no collectives, no I/O), called by
``trainer.py``.

Dimension legend: P prompts, G group size, B = P*G rows laid out group by group, S padded prompt+response length.
Per-token tensors use the ``TrainBatch`` layout: column ``s`` describes the prediction of ``input_ids[:, s]``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from gtpo_megatron.config import AlgorithmConfig, RolloutConfig
from gtpo_megatron.data.dynamic_sampling import filter_uniform_groups
from gtpo_megatron.ops import (
    LossSpec,
    build_conflict_weights,
    compute_group_advantages,
    conflict_normalizers,
    sequence_terms,
)
from gtpo_megatron.rollout.types import TrainBatch


@dataclass
class StepWeights:
    """Per-sequence and per-token quantities of one step's full batch, decided before the training forward.

    Attributes:
        raw_advantages: ``[B]`` fp32 group-relative advantages A_i (GTPO_SPEC section 2); the loss subtracts
            ``gamma <H>_i`` itself (``ops.policy_objective``).
        keep_mask: ``[B]`` bool row decision independent of the entropy: ``loss_row_mask`` (True = keep); the loss
            ANDs the entropy filter's delta_i into it.
        conflict_weights: ``[B, S]`` fp32 lambda of section 3 before any normalisation (1 or w on P+ rows, 0 or 1
            on P- rows), 0 off the response; the conflict metrics read it.
        token_weights: ``[B, S]`` fp32 per-token multiplier the loss receives: lambda (divided by
            ``max(1, n_i)`` with ``normalize_by_conflicts``), 0 on rows removed by ``loss_row_mask`` and off the
            response.
        loss_row_mask: ``[B]`` bool, False on rows removed from the objective (``skip_uniform_groups``,
            ``overlong_filter``): weight 0 and no count in the loss normaliser (``TrainBatch.loss_mask``); rows the
            entropy filter drops still count (GTPO_SPEC section 1).
        advantages: None (the loss computes ``A_i - gamma <H>_i``), or, after :func:`with_entropy_terms`, ``[B]``
            fp32 ``A_i - gamma <H>_i`` (``keep_mask`` then holds delta_i and ``token_weights`` lambda * delta_i).
    """

    raw_advantages: torch.Tensor
    keep_mask: torch.Tensor
    conflict_weights: torch.Tensor
    token_weights: torch.Tensor
    loss_row_mask: torch.Tensor
    advantages: torch.Tensor | None = None


def conflicts_need_entropy(cfg: AlgorithmConfig) -> bool:
    """Whether lambda depends on the completions' entropies (then they must be known before the forward).

    True with conflicts on and either ``conflict_sign: penalized`` with gamma > 0 (the sign of ``A_i - gamma
    <H>_i``) or ``exclude_filtered_from_conflicts`` with an entropy filter (delta_i of the other completions).
    """
    if cfg.conflict_mode == "off":
        return False
    penalized = cfg.conflict_sign == "penalized" and cfg.entropy_penalty > 0
    return penalized or (cfg.exclude_filtered_from_conflicts and cfg.entropy_filter != "off")


def needs_old_logprob_pass(cfg: AlgorithmConfig, *, initial_entropy_known: bool) -> bool:
    """Whether a step needs a no-grad forward pass before its update (GTPO_SPEC sections 1 and 4).

    With one update per batch nothing does: <H>_i, delta_i and the penalised advantage are computed in the
    training forward. A pass is unavoidable when (a) ``num_updates_per_batch > 1`` (the ratio needs pi_old), (b)
    the ``paper`` filter still measures <H>_ini (``initial_entropy_known`` False: the first
    ``initial_entropy_steps`` steps), or (c) lambda needs the entropies (:func:`conflicts_need_entropy`).
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
    """:func:`compute_weights` of a ``TrainBatch`` (its ``input_ids``, ``response_mask`` and ``truncated`` extra).

    Args:
        batch: the full (unsharded) step batch from ``collate_completions``.
        rewards: ``[B]`` shaped rewards (task score plus the overlong penalty): the advantages use them.
        cfg: algorithm section.
        loss_spec: as :func:`compute_weights`.
        seq_entropy: as :func:`compute_weights`.
        scores: as :func:`compute_weights` (a group whose answers all score the same is uniform even when the
            overlong penalty spreads its rewards).
    """
    return compute_weights(
        batch.input_ids,
        batch.response_mask,
        rewards,
        cfg,
        loss_spec=loss_spec,
        seq_entropy=seq_entropy,
        truncated=batch.extras.get("truncated"),
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
    """Advantages, row decisions and conflict weights of a whole step (GTPO_SPEC sections 2-4).

    The entropy terms (delta_i, ``A_i - gamma <H>_i``) are left to the loss (``ops.policy_objective``), or to
    :func:`with_entropy_terms` when the entropies are known beforehand.

    Args:
        input_ids: ``[B, S]`` int token ids, rows group by group (``cfg.group_size`` consecutive rows per prompt);
            only the columns where ``response_mask`` is True are read (any padding side, any pad id).
        response_mask: ``[B, S]`` bool, True on response tokens.
        rewards: ``[B]`` rewards.
        cfg: algorithm section.
        loss_spec: the step's objective (its entropy filter and penalty, with ``initial_entropy`` filled), used
            only when lambda depends on the entropies.
        seq_entropy: ``[B]`` per-completion mean entropy <H>_i in nats of a pass before the update (gathered over
            data-parallel ranks), or None when no such pass ran.
        truncated: ``[B]`` bool, completions cut at the token limit; required by ``cfg.overlong_filter``.
        scores: ``[B]`` task scores, on which ``skip_uniform_groups`` decides whether a group varies (never on
            rewards shaped by an overlong penalty); None when ``rewards`` are the task scores themselves.

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
        keep_mask=loss_row_B,
        conflict_weights=lambda_BS,
        token_weights=weights_BS * loss_row_B.unsqueeze(-1),
        loss_row_mask=loss_row_B,
    )


def build_loss_row_mask(
    scores: torch.Tensor, cfg: AlgorithmConfig, *, truncated: torch.Tensor | None = None
) -> torch.Tensor:
    """``[B]`` bool, False on rows the switches remove from the objective (loss and normaliser), True elsewhere.

    ``skip_uniform_groups`` removes every row of a group whose task ``scores`` are all equal (GTPO_SPEC section 4;
    the one rule of ``data.dynamic_sampling.filter_uniform_groups``; scores, not rewards shaped by an overlong penalty);
    ``overlong_filter`` removes the rows where ``truncated`` (``[B]`` bool) is True (DAPO, section 5);
    :func:`compute_weights` checks that it is given.
    """
    keep_B = torch.ones(scores.shape[0], dtype=torch.bool, device=scores.device)
    if cfg.skip_uniform_groups:
        keep_B &= filter_uniform_groups(scores, cfg.group_size).repeat_interleave(cfg.group_size)
    if cfg.overlong_filter:
        keep_B &= ~truncated.bool()
    return keep_B


def with_entropy_terms(weights: StepWeights, seq_entropy: torch.Tensor, loss_spec: LossSpec) -> StepWeights:
    """``weights`` with the entropy terms decided from known entropies, for a loss that does not apply them.

    ``advantages`` becomes ``A_i - gamma <H>_i``, ``keep_mask`` delta_i (and the row decisions) and
    ``token_weights`` ``lambda * delta_i`` (``ops.sequence_terms``, GTPO_SPEC section 4). Pair the result with a
    ``LossSpec`` whose entropy filter is ``off`` and penalty 0 (as ``megatron_adapter.loss_forms.loss_settings``
    makes it), or the terms would apply twice.

    Args:
        weights: from :func:`compute_weights`.
        seq_entropy: ``[B]`` <H>_i in nats.
        loss_spec: the step's objective (entropy filter, ``initial_entropy``, penalty).
    """
    terms = sequence_terms(seq_entropy, weights.raw_advantages, loss_spec, keep_mask=weights.keep_mask)
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

    ``gtpo/conflict_frac_pos``: response tokens of A > 0 completions with lambda > 1 (amplified);
    ``gtpo/conflict_frac_neg``: response tokens of A < 0 completions with lambda = 0; both over all response
    tokens, and ``gtpo/conflict_frac`` is their sum (``normalize_by_conflicts`` changes none of them);
    ``gtpo/removed_frac``: completions removed by ``skip_uniform_groups`` / ``overlong_filter`` (``loss_row_mask``).
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


OBJECTIVE_METRICS = {
    "entropy/completion_mean": ("seq_entropy_sum", "num_sequences"),
    "entropy/token_mean": ("entropy_sum", "num_tokens"),
    "gtpo/filtered_frac": ("filtered_sequences", "num_sequences"),
    "advantage/abs_mean": ("advantage_abs_sum", "num_sequences"),
    "mismatch/abs_logprob_diff": ("mismatch_abs_logprob_diff", "num_tokens"),
    "mismatch/prob_ratio_err": ("mismatch_prob_ratio_err", "num_tokens"),
}
"""Step metric -> (sum, count) of the training forward's metric sums (``ops.policy_objective`` and the loss closure,
reduced over micro-batches and data-parallel ranks). Entropies in nats at ``algorithm.entropy_temperature``;
"completion" means over completions with a response token, "token" over response tokens; the mismatch is |log
pi_train - log pi_rollout| and |pi_train / pi_rollout - 1| per response token at the sampling temperature, measured
before the update."""


def objective_metrics(train_metrics: dict[str, float]) -> dict[str, float]:
    """The :data:`OBJECTIVE_METRICS` present in ``train_metrics`` (a count of 0 gives 0)."""
    return {
        name: train_metrics[total] / max(train_metrics[count], 1.0)
        for name, (total, count) in OBJECTIVE_METRICS.items()
        if total in train_metrics and count in train_metrics
    }


def loss_temperature(algorithm: AlgorithmConfig, rollout: RolloutConfig) -> float:
    """The log-prob temperature of the loss: ``rollout.temperature`` for ``loss_temperature: sampling``, else 1."""
    return rollout.temperature if algorithm.loss_temperature == "sampling" else float(algorithm.loss_temperature)


def build_loss_spec(algorithm: AlgorithmConfig, rollout: RolloutConfig) -> LossSpec:
    """The step objective of ``algorithm`` (GTPO_SPEC sections 1, 4 and 5) as the policy receives it.

    Log-probs at :func:`loss_temperature`, entropy at ``algorithm.entropy_temperature``; the entropy filter and
    penalty as configured (``initial_entropy`` stays None until the trainer has measured <H>_ini); Dr. GRPO's
    constant normaliser uses L = ``rollout.max_tokens``.
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
    )
