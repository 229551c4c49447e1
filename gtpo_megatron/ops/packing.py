"""Packed (THD) rows <-> the padded row layout: several sequences in one row, as Megatron-LM's RL bins hold them.

N columns of one packed row, n sequences in it, L the longest. Column ``j`` of padded row ``k`` (``[n, L]``, left
aligned) is column ``seq_starts[k] + j`` of the packed row; columns outside every sequence are read by nothing and
written as 0. Per-token tensors may carry trailing dims (``[1, N, ...]`` <-> ``[n, L, ...]``, e.g. routed experts
``[.., L_moe, K]``). Per-sequence GTPO quantities are computed on the padded layout, so a packed row gives exactly the
padded result. Pure torch indexing, differentiable.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PackedLayout:
    """Where the sequences of one packed row sit: first column and token count of each, non-overlapping."""

    seq_starts: tuple[int, ...]
    seq_lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.seq_starts) != len(self.seq_lengths):
            raise ValueError(
                f"seq_starts has {len(self.seq_starts)} entries and seq_lengths {len(self.seq_lengths)}; give one "
                "start and one length per sequence of the packed row"
            )
        ends = [s + n for s, n in zip(self.seq_starts, self.seq_lengths)]
        if any(s < 0 for s in self.seq_starts) or any(n < 0 for n in self.seq_lengths):
            raise ValueError(f"seq_starts={self.seq_starts} and seq_lengths={self.seq_lengths} must be >= 0")
        if any(end > start for end, start in zip(ends, self.seq_starts[1:])):
            raise ValueError(
                f"sequences overlap: seq_starts={self.seq_starts}, seq_lengths={self.seq_lengths}; sequence k must "
                "end (start + length) at or before sequence k+1 starts"
            )

    @classmethod
    def of(cls, seq_starts: Sequence[int] | torch.Tensor, seq_lengths: Sequence[int] | torch.Tensor) -> PackedLayout:
        """Layout from lists or tensors; a trailing extra start (Megatron-LM's bin end offset) is dropped."""
        starts = [int(s) for s in seq_starts]
        lengths = [int(n) for n in seq_lengths]
        if len(starts) == len(lengths) + 1:
            starts = starts[:-1]
        return cls(tuple(starts), tuple(lengths))

    @property
    def num_sequences(self) -> int:
        """n, the number of sequences in the row."""
        return len(self.seq_lengths)

    def segment_ids(self, width: int) -> torch.Tensor:
        """``[N]`` int64: sequence ``k`` on its columns; every other column ``n + column`` (a segment of its own).

        Two columns may attend to each other only within one segment: the block-diagonal causal mask.
        """
        segments = torch.arange(width, dtype=torch.long) + self.num_sequences
        for k, (start, length) in enumerate(zip(self.seq_starts, self.seq_lengths)):
            segments[start : start + length] = k
        return segments

    def _index(self, width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``([n, L] int64 packed column of each padded cell, [n, L] bool cell holds a token)``."""
        end = max((s + n for s, n in zip(self.seq_starts, self.seq_lengths)), default=0)
        if end > width:
            raise ValueError(
                f"the last sequence ends at column {end} but the packed row has {width} columns; seq_starts and "
                "seq_lengths must describe this row"
            )
        longest = max(self.seq_lengths, default=0)
        columns = torch.arange(longest, device=device)
        starts = torch.tensor(self.seq_starts, dtype=torch.long, device=device).reshape(-1, 1)
        lengths = torch.tensor(self.seq_lengths, dtype=torch.long, device=device).reshape(-1, 1)
        valid = columns < lengths
        return torch.where(valid, starts + columns, 0), valid

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """``[1, N, ...]`` (or ``[N]``) -> ``[n, L, ...]``, same dtype, 0 past each sequence's length (a gather).

        Raises:
            ValueError: ``packed`` is not one row, or a sequence ends past column N.
        """
        row = _one_row(packed)
        index, valid = self._index(row.shape[0], row.device)
        valid = valid.reshape(*valid.shape, *([1] * (row.dim() - 1)))
        return torch.where(valid, row[index], torch.zeros((), dtype=row.dtype, device=row.device))

    def pack(self, rows: torch.Tensor, width: int) -> torch.Tensor:
        """Inverse of :meth:`unpack`: ``[n, >= L, ...]`` -> ``[1, width, ...]``, 0 outside every sequence.

        Raises:
            ValueError: ``rows`` has the wrong number of rows or is too short, or a sequence ends past ``width``.
        """
        index, valid = self._index(width, rows.device)
        if rows.dim() < 2 or rows.shape[0] != self.num_sequences or rows.shape[1] < index.shape[1]:
            raise ValueError(
                f"rows has shape {tuple(rows.shape)}; expected [n, >= L] = [{self.num_sequences}, "
                f">= {index.shape[1]}] (trailing dims free) for this layout"
            )
        out = torch.zeros(width, *rows.shape[2:], dtype=rows.dtype, device=rows.device)
        return out.index_put((index[valid],), rows[:, : index.shape[1]][valid]).unsqueeze(0)


def _one_row(packed: torch.Tensor) -> torch.Tensor:
    if packed.dim() >= 2 and packed.shape[0] == 1:
        return packed[0]
    if packed.dim() == 1:
        return packed
    raise ValueError(
        f"a packed tensor must be one row, [1, N, ...] or [N]; got shape {tuple(packed.shape)} (pass one packed row "
        "per call, as Megatron-LM's RL loader does: one bin per micro-batch)"
    )
