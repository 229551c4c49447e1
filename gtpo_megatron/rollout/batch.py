"""One step's rollouts as tensors: collation into a ``TrainBatch`` and the batch's rollout metrics.

Pure functions of tensors (no collectives, no I/O), composed by ``trainer.py``. Every rank builds the same full
batch (the rollouts are broadcast); the GTPO weights are computed on whole groups (``algorithm.py``,
docs/algorithm.md section 8) before each rank keeps its rows, ``batch.select(plan.layout.row_shard(...))``.
Dimension legend: P prompts, G group size, B = P*G rows group by group, S padded prompt+response length.
"""

from __future__ import annotations

import torch

from gtpo_megatron.batch import TrainBatch
from gtpo_megatron.data.overlong import overlong_filter_mask
from gtpo_megatron.rollout.types import PromptCompletions


def collate_completions(groups: list[PromptCompletions], *, pad_token_id: int) -> TrainBatch:
    """Right-padded ``TrainBatch`` of every completion, group by group.

    ``pad_token_id`` fills padding columns (it may equal EOS: masks come from lengths, never from ids). Fills
    ``input_ids``, ``token_mask``, ``response_mask``, ``rollout_logprobs`` (0 off the response) and ``truncated``
    (finish_reason ``"length"``); ``routed_experts`` (ids + 1 of each completion's recorded tokens, 0 elsewhere)
    when the completions carry them.

    Raises:
        ValueError: no groups, groups of different sizes, or routed experts on some completions only.
    """
    sizes = {len(g.completions) for g in groups}
    if len(sizes) != 1:
        raise ValueError(f"every prompt needs the same number of completions; got sizes {sorted(sizes)}")
    rows = [(g.prompt_ids, c) for g in groups for c in g.completions]
    seq_len = max(len(prompt) + len(c.token_ids) for prompt, c in rows)
    num_rows = len(rows)
    input_ids = torch.full((num_rows, seq_len), pad_token_id, dtype=torch.long)
    token_mask = torch.zeros((num_rows, seq_len), dtype=torch.bool)
    response_mask = torch.zeros((num_rows, seq_len), dtype=torch.bool)
    rollout_logprobs = torch.zeros((num_rows, seq_len), dtype=torch.float32)
    for row, (prompt, completion) in enumerate(rows):
        start, end = len(prompt), len(prompt) + len(completion.token_ids)
        input_ids[row, :end] = torch.tensor(list(prompt) + list(completion.token_ids), dtype=torch.long)
        token_mask[row, :end] = True
        response_mask[row, start:end] = True
        if completion.rollout_logprobs:
            rollout_logprobs[row, start:end] = torch.tensor(completion.rollout_logprobs, dtype=torch.float32)
    return TrainBatch(
        input_ids=input_ids,
        token_mask=token_mask,
        response_mask=response_mask,
        rollout_logprobs=rollout_logprobs,
        truncated=~overlong_filter_mask([c.finish_reason for _, c in rows]),
        routed_experts=_routed_experts([c.routed_experts for _, c in rows], seq_len),
    )


def collate_token_versions(groups: list[PromptCompletions], seq_len: int) -> torch.Tensor:
    """``[B, S]`` int64: the policy version that sampled each response token (``Completion.token_versions``).

    Rows and columns as :func:`collate_completions`'s; 0 off the response (masked by ``response_mask``).

    Raises:
        ValueError: a completion without ``token_versions`` (partial rollouts record them for every token).
    """
    versions = torch.zeros(sum(len(g.completions) for g in groups), seq_len, dtype=torch.long)
    rows = [(g.prompt_ids, c) for g in groups for c in g.completions]
    for row, (prompt, completion) in enumerate(rows):
        if completion.token_versions is None:
            raise ValueError(f"completion {row} records no token versions; rollout.partial_rollouts engines do")
        start = len(prompt)
        versions[row, start : start + len(completion.token_versions)] = torch.tensor(completion.token_versions)
    return versions


def _routed_experts(per_row: list[torch.Tensor | None], seq_len: int) -> torch.Tensor | None:
    """``[B, S, L, K]`` int16 ids + 1 of each row's ``[n, L, K]`` routed experts (0 past ``n``); None if none has them.

    Raises:
        ValueError: some rows carry routed experts and others do not.
    """
    present = [routed is not None for routed in per_row]
    if not any(present):
        return None
    if not all(present):
        raise ValueError(
            f"{present.count(False)} of {len(per_row)} completions carry no routed experts; with routing replay "
            "every engine must return them (rollout.routing_replay=rollout starts each engine so)"
        )
    shape = per_row[0].shape[1:]
    routed = torch.zeros(len(per_row), seq_len, *shape, dtype=torch.int16)
    for row, experts in enumerate(per_row):
        n = min(experts.shape[0], seq_len)
        routed[row, :n] = experts[:n].to(torch.int16) + 1
    return routed


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
        "response/truncated_frac": float(batch.truncated.float().mean()),
    }
