"""Turn one step's rollouts and rewards into a ``TrainBatch``: padding, masks, group ids, advantages, weights.

Pure functions of tensors and config sections (no collectives, no I/O), composed by ``trainer.py``. Every rank
builds the same full batch (the rollouts are broadcast), computes advantages and GTPO token weights on whole groups
(GTPO_SPEC section 8: lambda is computed before the batch is split over data-parallel ranks) and then keeps its own
rows with ``shard_rows``.

Dimension legend: P prompts, G group size, B = P*G rows laid out group by group, S padded prompt+response length.
Per-token tensors use the ``TrainBatch`` layout: column ``s`` describes the prediction of ``input_ids[:, s]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gtpo_megatron.config import AlgorithmConfig
from gtpo_megatron.data.sampling import overlong_filter_mask, overlong_penalty
from gtpo_megatron.ops import (
    apply_entropy_penalty,
    build_conflict_weights,
    compute_group_advantages,
    conflict_normalizers,
    entropy_keep_mask,
    nonuniform_group_mask,
)
from gtpo_megatron.rollout.types import PromptCompletions, TrainBatch


def collate_completions(groups: list[PromptCompletions], *, pad_token_id: int) -> TrainBatch:
    """Right-padded ``TrainBatch`` of every completion, group by group.

    Args:
        groups: P prompts, each with the same number G of completions.
        pad_token_id: id written in padding columns (may equal EOS: masks come from lengths, never from ids).

    Returns:
        ``TrainBatch`` with ``input_ids``/``attention_mask``/``response_mask`` ``[B, S]``, ``group_ids`` ``[B]``
        and extras ``rollout_logprobs`` ``[B, S]`` fp32 (engine log-probs on response columns, 0 elsewhere) and
        ``truncated`` ``[B]`` bool (finish_reason ``"length"``).

    Raises:
        ValueError: no groups, or groups of different sizes.
    """
    sizes = {len(g.completions) for g in groups}
    if len(sizes) != 1:
        raise ValueError(f"every prompt needs the same number of completions; got sizes {sorted(sizes)}")
    rows = [(g.prompt_ids, c, p) for p, g in enumerate(groups) for c in g.completions]
    seq_len = max(len(prompt) + len(c.token_ids) for prompt, c, _ in rows)
    num_rows = len(rows)
    input_ids = torch.full((num_rows, seq_len), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((num_rows, seq_len), dtype=torch.bool)
    response_mask = torch.zeros((num_rows, seq_len), dtype=torch.bool)
    rollout_logprobs = torch.zeros((num_rows, seq_len), dtype=torch.float32)
    for row, (prompt, completion, _) in enumerate(rows):
        start, end = len(prompt), len(prompt) + len(completion.token_ids)
        input_ids[row, :end] = torch.tensor(list(prompt) + list(completion.token_ids), dtype=torch.long)
        attention_mask[row, :end] = True
        response_mask[row, start:end] = True
        if completion.rollout_logprobs:
            rollout_logprobs[row, start:end] = torch.tensor(completion.rollout_logprobs, dtype=torch.float32)
    return TrainBatch(
        input_ids=input_ids, attention_mask=attention_mask, response_mask=response_mask,
        group_ids=torch.tensor([p for _, _, p in rows], dtype=torch.long),
        extras={"rollout_logprobs": rollout_logprobs,
                "truncated": ~overlong_filter_mask([c.finish_reason for _, c, _ in rows])},
    )


def shape_rewards(scores: torch.Tensor, response_lengths: torch.Tensor, cfg: AlgorithmConfig,
                  *, max_tokens: int) -> torch.Tensor:
    """Task scores plus DAPO's overlong penalty when ``cfg.overlong_buffer_len > 0`` (GTPO_SPEC section 5).

    Args:
        scores: ``[B]`` reward-function scores.
        response_lengths: ``[B]`` response tokens per completion.
        max_tokens: L_max, the sampling limit.

    Returns:
        ``[B]`` fp32 rewards used for the advantages.
    """
    rewards = scores.float()
    if cfg.overlong_buffer_len > 0:
        buffer = min(cfg.overlong_buffer_len, max_tokens)
        rewards = rewards + overlong_penalty(response_lengths, max_tokens, buffer, cfg.overlong_penalty)
    return rewards


def choose_groups(varied: list[bool], num_prompts: int) -> list[int]:
    """DAPO dynamic sampling's pick: the first ``num_prompts`` groups with varied rewards, in sampling order,
    topped up with uniform groups (zero advantage) when the rounds ran out, so the batch shape never changes."""
    picked = [i for i, v in enumerate(varied) if v][:num_prompts]
    filler = [i for i, v in enumerate(varied) if not v][: num_prompts - len(picked)]
    return sorted(picked + filler)


@dataclass
class StepWeights:
    """Per-sequence and per-token quantities of one step's full batch.

    Attributes:
        raw_advantages: ``[B]`` fp32 group-relative advantages A_i (GTPO_SPEC section 2).
        advantages: ``[B]`` fp32 advantages used by the loss (A_i - gamma <H>_i, section 4).
        keep_mask: ``[B]`` bool delta_i (True = completion enters the loss).
        conflict_weights: ``[B, S]`` fp32 lambda before the filter (section 3), 0 off the response.
        token_weights: ``[B, S]`` fp32 lambda * delta_i (and overlong filtering), 0 off the response.
    """

    raw_advantages: torch.Tensor
    advantages: torch.Tensor
    keep_mask: torch.Tensor
    conflict_weights: torch.Tensor
    token_weights: torch.Tensor


def compute_step_weights(batch: TrainBatch, rewards: torch.Tensor, seq_entropy: torch.Tensor, cfg: AlgorithmConfig,
                         *, initial_entropy: float | None) -> StepWeights:
    """Advantages, the entropy filter and conflict weights of the full batch (GTPO_SPEC sections 2-4).

    Args:
        batch: the full (unsharded) step batch from ``collate_completions``.
        rewards: ``[B]`` shaped rewards.
        seq_entropy: ``[B]`` per-completion mean entropy <H>_i in nats (global, gathered over data-parallel ranks).
        cfg: algorithm section.
        initial_entropy: <H>_ini for the ``paper`` filter (None for the other modes).
    """
    group_size = cfg.group_size
    raw_B = compute_group_advantages(rewards, group_size, estimator=cfg.advantage_estimator)
    keep_B = entropy_keep_mask(seq_entropy, mode=cfg.entropy_filter, threshold=cfg.entropy_threshold,
                               initial_entropy=initial_entropy, advantages=raw_B,
                               only_negative=cfg.entropy_only_negative)
    if cfg.skip_uniform_groups:
        keep_B = keep_B & nonuniform_group_mask(rewards, group_size)
    conflict_adv_B = raw_B * keep_B if cfg.exclude_filtered_from_conflicts else raw_B
    ids, mask = batch.input_ids, batch.response_mask
    if cfg.conflict_mode == "off":
        lambda_BS = mask.float()
    else:
        lambda_BS = build_conflict_weights(ids, mask, conflict_adv_B, group_size,
                                           amplification=cfg.conflict_amplification, mode=cfg.conflict_mode,
                                           overlap=cfg.conflict_overlap)
        if cfg.normalize_by_conflicts:
            lambda_BS = lambda_BS / conflict_normalizers(ids, mask, conflict_adv_B, group_size,
                                                         mode=cfg.conflict_mode).unsqueeze(-1)
    row_keep_B = keep_B & ~batch.extras["truncated"] if cfg.overlong_filter else keep_B
    advantages_B = apply_entropy_penalty(raw_B, seq_entropy, cfg.entropy_penalty)
    return StepWeights(raw_advantages=raw_B, advantages=advantages_B, keep_mask=keep_B,
                       conflict_weights=lambda_BS, token_weights=lambda_BS * row_keep_B.unsqueeze(-1))


def weight_metrics(weights: StepWeights, response_mask: torch.Tensor) -> dict[str, float]:
    """Filter and conflict fractions of the full batch.

    ``gtpo/conflict_frac_pos``: response tokens of A > 0 completions whose lambda differs from 1 (amplified);
    ``gtpo/conflict_frac_neg``: response tokens of A < 0 completions with lambda = 0; both over all response
    tokens, and ``gtpo/conflict_frac`` is their sum. ``gtpo/filtered_frac``: completions with delta = 0.
    """
    num_tokens = response_mask.sum().clamp(min=1).float()
    lam = weights.conflict_weights
    pos = response_mask & (weights.raw_advantages > 0).unsqueeze(-1) & (lam != 1)
    neg = response_mask & (weights.raw_advantages < 0).unsqueeze(-1) & (lam == 0)
    frac_pos, frac_neg = float(pos.sum() / num_tokens), float(neg.sum() / num_tokens)
    return {"gtpo/filtered_frac": float((~weights.keep_mask).float().mean()),
            "gtpo/conflict_frac": frac_pos + frac_neg, "gtpo/conflict_frac_pos": frac_pos,
            "gtpo/conflict_frac_neg": frac_neg, "advantage/abs_mean": float(weights.advantages.abs().mean())}


def shard_rows(batch: TrainBatch, *, dp_rank: int, dp_size: int) -> TrainBatch:
    """Rows ``[dp_rank * B/dp, (dp_rank + 1) * B/dp)`` of every tensor (per-token weights travel with rows).

    Raises:
        ValueError: if ``dp_size`` does not divide B.
    """
    rows = batch.num_sequences
    if rows % dp_size:
        raise ValueError(f"batch of {rows} rows does not split over dp_size={dp_size}; see GTPOConfig.validate")
    share = rows // dp_size
    return batch.select(slice(dp_rank * share, (dp_rank + 1) * share))


def mismatch_sums(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                  response_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sums for the train/rollout mismatch on local rows (divide by ``count`` after reducing over dp).

    ``abs_logprob_diff``: sum of |log pi_train - log pi_rollout|; ``prob_ratio_err``: sum of
    |pi_train / pi_rollout - 1|; both over response tokens, in nats / unitless; ``count``: response tokens.
    """
    delta = torch.where(response_mask, old_logprobs.float() - rollout_logprobs.float(), 0.0)
    ratio_err = torch.where(response_mask, torch.expm1(delta).abs(), 0.0)
    return {"abs_logprob_diff": delta.abs().sum(), "prob_ratio_err": ratio_err.sum(),
            "count": response_mask.sum().float()}


def rollout_metrics(batch: TrainBatch, scores: torch.Tensor, correct: torch.Tensor,
                    format_ok: torch.Tensor) -> dict[str, float]:
    """Reward, accuracy, format rate and response-length statistics of the full batch (``[B]`` inputs)."""
    lengths = batch.response_mask.sum(dim=-1).float()
    return {"reward/mean": float(scores.float().mean()), "reward/std": float(scores.float().std(unbiased=False)),
            "accuracy": float(correct.float().mean()), "format_rate": float(format_ok.float().mean()),
            "response/length_mean": float(lengths.mean()), "response/length_max": float(lengths.max()),
            "response/truncated_frac": float(batch.extras["truncated"].float().mean())}
