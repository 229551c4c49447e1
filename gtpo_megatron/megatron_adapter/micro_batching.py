"""A data-parallel rank's ``TrainBatch`` cut into the ``MicroBatch`` es of Megatron's schedule, and their shape metrics.

Three ways, chosen by ``optim``:

* fixed rows (``micro_batch_size``, no token budget): equal micro-batches of the batch's width, the last one
  completed with fully masked rows;
* token budget, padded: ``plan.micro_batches.plan_micro_batches`` rows, each micro-batch right padded to its own
  longest row;
* token budget, packed: the same planner, each micro-batch one row ``[1, N]`` of its sequences back to back
  (``ops.PackedLayout``), per-sequence position ids and a block-diagonal causal mask (local spec) or Megatron's
  THD ``PackedSeqParams`` (Transformer Engine).

A sequence is ``token_mask``'s prefix of its row (``rollout.batch.collate_completions``). With sequence parallelism
every width is a multiple of ``tp_size``. Under expert parallelism every rank of an EP group must run as many
micro-batches (each MoE layer's token exchange joins them all): :func:`equal_counts` completes the shorter lists with
idle micro-batches. No collectives, except :func:`equal_counts` and :func:`micro_batch_metrics` (their docstrings).
"""

from __future__ import annotations

import dataclasses

import torch

from gtpo_megatron.batch import TrainBatch
from gtpo_megatron.megatron_adapter import model as model_lib
from gtpo_megatron.megatron_adapter.forward_step import MicroBatch
from gtpo_megatron.ops import PackedLayout
from gtpo_megatron.parallel.collectives import all_reduce_
from gtpo_megatron.plan.micro_batches import TokenBudget, plan_micro_batches


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _columns(t: torch.Tensor, width: int) -> torch.Tensor:
    """The first ``width`` columns of a per-token ``[B, S, ...]`` (zero-padded past its own); ``[B]`` unchanged."""
    if t.dim() < 2:
        return t
    if width <= t.shape[1]:
        return t[:, :width]
    return torch.cat([t, t.new_zeros((t.shape[0], width - t.shape[1], *t.shape[2:]))], dim=1)


def fixed_micro_batches(
    batch: TrainBatch, micro_batch_size: int, *, width_multiple: int, backend: str, device: torch.device
) -> list[MicroBatch]:
    """Micro-batches of ``micro_batch_size`` rows at the batch's width (padding rows: every mask False)."""
    rows, seq_len = batch.input_ids.shape
    pad = (-rows) % micro_batch_size
    width = _round_up(seq_len, width_multiple)

    def prepare(t: torch.Tensor) -> torch.Tensor:
        t = torch.cat([t, t.new_zeros((pad, *t.shape[1:]))]) if pad else t
        return _columns(t, width).to(device)

    padded = batch.apply(prepare)
    positions = torch.arange(width, device=device).expand(micro_batch_size, -1)
    mask = _to(model_lib.causal_attention_mask(width, backend), device)
    return [
        MicroBatch.of(
            padded.select(slice(start, start + micro_batch_size)),
            position_ids=positions,
            attention_mask=mask,
            source_rows=tuple(r if r < rows else -1 for r in range(start, start + micro_batch_size)),
        )
        for start in range(0, rows + pad, micro_batch_size)
    ]


def budget_micro_batches(
    batch: TrainBatch, budget: TokenBudget, *, width_multiple: int, backend: str, device: torch.device
) -> list[MicroBatch]:
    """Micro-batches under ``budget`` (``plan_micro_batches``), padded to their longest row or packed.

    Raises:
        ValueError: no ``token_mask``, or a sequence longer than the budget.
    """
    lengths = batch.sequence_lengths()
    cut = _packed if budget.packing else _padded
    return [
        cut(batch, rows, [lengths[r] for r in rows], width_multiple=width_multiple, backend=backend, device=device)
        for rows in plan_micro_batches(lengths, budget)
    ]


def _padded(batch: TrainBatch, rows: list[int], lengths: list[int], *, width_multiple, backend, device) -> MicroBatch:
    width = _round_up(max(lengths), width_multiple)
    record = batch.select(torch.tensor(rows)).apply(lambda t: _columns(t, width).to(device))
    positions = torch.arange(width, device=device).expand(len(rows), -1)
    mask = _to(model_lib.causal_attention_mask(width, backend), device)
    return MicroBatch.of(record, position_ids=positions, attention_mask=mask, source_rows=tuple(rows))


def _packed(batch: TrainBatch, rows: list[int], lengths: list[int], *, width_multiple, backend, device) -> MicroBatch:
    starts = [sum(lengths[:k]) for k in range(len(lengths))]
    layout = PackedLayout.of(starts, lengths)
    width, longest = _round_up(sum(lengths), width_multiple), max(lengths)
    record = batch.select(torch.tensor(rows)).apply(lambda t: layout.pack(t[:, :longest], width) if t.dim() >= 2 else t)
    positions = layout.pack(torch.arange(longest).expand(len(rows), -1), width)
    segments = layout.segment_ids(width)
    return MicroBatch.of(
        record.apply(lambda t: t.to(device)),
        position_ids=positions.to(device),
        attention_mask=_to(model_lib.causal_attention_mask(width, backend, segment_ids=segments), device),
        source_rows=tuple(rows),
        layout=layout,
        packed_seq_params=_thd_params(layout, width, device) if backend == "transformer_engine" else None,
    )


def _thd_params(layout: PackedLayout, width: int, device: torch.device):
    """Megatron's ``PackedSeqParams`` (THD) of a packed row; the columns after the last sequence are one more."""
    from megatron.core.packed_seq_params import PackedSeqParams

    bounds = [0, *(s + n for s, n in zip(layout.seq_starts, layout.seq_lengths))]
    if bounds[-1] < width:
        bounds.append(width)
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=device)
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens, max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )  # fmt: skip


def equal_counts(micro_batches: list[MicroBatch], *, group) -> list[MicroBatch]:
    """``micro_batches`` completed to the longest list of ``group`` with idle copies of the last micro-batch.

    An idle micro-batch has every mask False, no source rows and no routed experts (its routers choose their own, and
    routing replay counts no agreement for it): it adds nothing to the loss, the gradient or the log-probs (only its
    forward tokens, counted as padding). Collectives: one MAX all-reduce on ``group``.
    """
    count = int(all_reduce_(torch.tensor([float(len(micro_batches))]), op="max", group=group)[0])
    last = micro_batches[-1]
    idle = dataclasses.replace(
        last,
        token_mask=None if last.token_mask is None else torch.zeros_like(last.token_mask),
        response_mask=torch.zeros_like(last.response_mask),
        source_rows=(-1,) * len(last.source_rows),
        routed_experts=None,
    )
    return micro_batches + [idle] * (count - len(micro_batches))


def _to(mask: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if mask is None else mask.to(device)


def micro_batch_metrics(micro_batches: list[MicroBatch], *, group) -> dict[str, float]:
    """``perf/`` shape metrics of the step's training forward over every DP rank of ``group``.

    ``padding_frac`` (forward tokens outside every sequence / all forward tokens; only when ``token_mask`` is set),
    ``micro_batches`` (per DP rank, the most), ``tokens_per_micro_batch_min`` / ``_max`` (forward tokens, padding
    included). Collectives: one SUM and one MAX all-reduce on ``group`` (None: this process alone).
    """
    sizes = [mb.input_ids.numel() for mb in micro_batches]
    known = all(mb.token_mask is not None for mb in micro_batches)
    real = sum(int(mb.token_mask.sum()) for mb in micro_batches) if known else 0
    summed = all_reduce_(torch.tensor([float(sum(sizes)), float(real)]), op="sum", group=group)
    extremes = torch.tensor([float(len(sizes)), float(max(sizes)), -float(min(sizes))])
    extremes = all_reduce_(extremes, op="max", group=group)
    metrics = {
        "perf/micro_batches": float(extremes[0]),
        "perf/tokens_per_micro_batch_min": float(-extremes[2]),
        "perf/tokens_per_micro_batch_max": float(extremes[1]),
    }
    if known:
        metrics["perf/padding_frac"] = float(1.0 - summed[1] / summed[0])
    return metrics
