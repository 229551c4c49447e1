"""One step's rollouts as tensors: collation into a ``TrainBatch`` and the batch, rollout and mismatch metrics.

Pure functions of tensors (no collectives, no I/O), composed by ``trainer.py``. Every rank builds the same full
batch (the rollouts are broadcast), the GTPO weights are computed on whole groups (``algorithm.py``; GTPO_SPEC
section 8: lambda is computed before the batch is split over data-parallel ranks) and each rank then keeps its own
rows, ``batch.select(plan.layout.row_shard(...))``.

Dimension legend: P prompts, G group size, B = P*G rows laid out group by group, S padded prompt+response length.
Per-token tensors use the ``TrainBatch`` layout: column ``s`` describes the prediction of ``input_ids[:, s]``.
"""

from __future__ import annotations

import torch

from gtpo_megatron.data.overlong import overlong_filter_mask
from gtpo_megatron.rollout.types import PromptCompletions, TrainBatch


def collate_completions(groups: list[PromptCompletions], *, pad_token_id: int) -> TrainBatch:
    """Right-padded ``TrainBatch`` of every completion, group by group.

    Args:
        groups: P prompts, each with the same number G of completions.
        pad_token_id: id written in padding columns (may equal EOS: masks come from lengths, never from ids).

    Returns:
        ``TrainBatch`` with ``input_ids``/``attention_mask``/``response_mask`` ``[B, S]`` and extras
        ``rollout_logprobs`` ``[B, S]`` fp32 (engine log-probs on response columns, 0 elsewhere) and
        ``truncated`` ``[B]`` bool (finish_reason ``"length"``).

    Raises:
        ValueError: no groups, or groups of different sizes.
    """
    sizes = {len(g.completions) for g in groups}
    if len(sizes) != 1:
        raise ValueError(f"every prompt needs the same number of completions; got sizes {sorted(sizes)}")
    rows = [(g.prompt_ids, c) for g in groups for c in g.completions]
    seq_len = max(len(prompt) + len(c.token_ids) for prompt, c in rows)
    num_rows = len(rows)
    input_ids = torch.full((num_rows, seq_len), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((num_rows, seq_len), dtype=torch.bool)
    response_mask = torch.zeros((num_rows, seq_len), dtype=torch.bool)
    rollout_logprobs = torch.zeros((num_rows, seq_len), dtype=torch.float32)
    for row, (prompt, completion) in enumerate(rows):
        start, end = len(prompt), len(prompt) + len(completion.token_ids)
        input_ids[row, :end] = torch.tensor(list(prompt) + list(completion.token_ids), dtype=torch.long)
        attention_mask[row, :end] = True
        response_mask[row, start:end] = True
        if completion.rollout_logprobs:
            rollout_logprobs[row, start:end] = torch.tensor(completion.rollout_logprobs, dtype=torch.float32)
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=response_mask,
        extras={
            "rollout_logprobs": rollout_logprobs,
            "truncated": ~overlong_filter_mask([c.finish_reason for _, c in rows]),
        },
    )


def mismatch_sums(
    train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Sums for the train/rollout mismatch on local rows (divide by ``count`` after reducing over dp).

    ``train_logprobs`` are the trainer's log-probs of the same weights the engine sampled with (the training
    forward before its update), at the sampling temperature; all tensors ``[B, S]``. ``abs_logprob_diff``: sum of
    |log pi_train - log pi_rollout|; ``prob_ratio_err``: sum of |pi_train / pi_rollout - 1|; both over response
    tokens, in nats / unitless; ``count``: response tokens.
    """
    delta = torch.where(response_mask, train_logprobs.float() - rollout_logprobs.float(), 0.0)
    ratio_err = torch.where(response_mask, torch.expm1(delta).abs(), 0.0)
    return {
        "abs_logprob_diff": delta.abs().sum(),
        "prob_ratio_err": ratio_err.sum(),
        "count": response_mask.sum().float(),
    }


def rollout_metrics(
    batch: TrainBatch, scores: torch.Tensor, correct: torch.Tensor, format_ok: torch.Tensor
) -> dict[str, float]:
    """Reward, accuracy, format rate and response-length statistics of the full batch (``[B]`` inputs)."""
    lengths = batch.response_mask.sum(dim=-1).float()
    return {
        "reward/mean": float(scores.float().mean()),
        "reward/std": float(scores.float().std(unbiased=False)),
        "accuracy": float(correct.float().mean()),
        "format_rate": float(format_ok.float().mean()),
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "response/truncated_frac": float(batch.extras["truncated"].float().mean()),
    }
