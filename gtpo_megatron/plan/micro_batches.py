"""Token-budget micro-batches: which rows share a micro-batch, and which data-parallel rank trains each row.

Pure integer arithmetic on sequence lengths (prompt + response tokens), the same on every rank. A micro-batch's
cost is what the training forward runs on: with packing the sum of its lengths (one row, no padding), without it
``rows x longest`` (right padded to its own longest row). Both planners are greedy in decreasing length:

* :func:`plan_micro_batches`: first-fit decreasing bins under ``max_tokens_per_micro_batch`` (at most 11/9 of the
  optimal count plus one bin for packing; a sorted prefix cut is optimal for the padded cost);
* :func:`balanced_row_shards`: every DP rank gets ``B / D`` rows (the step's gathers need equal shares), each row
  going to the rank with the fewest tokens so far that still has room, so ranks finish their forwards together.

The GTPO weights are computed on whole groups before the rows are dealt (docs/algorithm.md section 8), so which
rank or micro-batch holds a row changes no value: only the order of floating-point sums.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gtpo_megatron.plan.layout import row_shard


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenBudget:
    """Micro-batches formed by tokens (``optim.max_tokens_per_micro_batch``, ``optim.packing``)."""

    max_tokens: int
    """Tokens the training forward runs on per micro-batch, padding included."""
    packing: bool = False
    """Several sequences in one row (block-diagonal attention) rather than right-padded rows."""

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(
                f"optim.max_tokens_per_micro_batch={self.max_tokens} must be >= 1; use at least "
                "rollout.max_prompt_len + rollout.max_tokens"
            )

    def cost(self, lengths: Sequence[int]) -> int:
        """Tokens of one micro-batch holding sequences of ``lengths``."""
        if self.packing:
            return sum(lengths)
        return len(lengths) * max(lengths, default=0)


def _check_fits(lengths: Sequence[int], budget: TokenBudget) -> None:
    longest = max(lengths, default=0)
    if longest > budget.max_tokens:
        raise ValueError(
            f"a sequence of {longest} tokens (prompt + response) exceeds optim.max_tokens_per_micro_batch="
            f"{budget.max_tokens}; a sequence is never split over micro-batches: raise the budget to at least "
            "rollout.max_prompt_len + rollout.max_tokens"
        )


def _decreasing(lengths: Sequence[int]) -> list[int]:
    """Row indices by decreasing length, ties by index (deterministic on every rank)."""
    return sorted(range(len(lengths)), key=lambda row: (-lengths[row], row))


def plan_micro_batches(lengths: Sequence[int], budget: TokenBudget) -> list[list[int]]:
    """Rows (indices into ``lengths``) of each micro-batch, every micro-batch's cost ``<= budget.max_tokens``.

    Rows inside a micro-batch are in decreasing length; an empty ``lengths`` gives no micro-batch.

    Raises:
        ValueError: a sequence longer than the budget.
    """
    _check_fits(lengths, budget)
    bins: list[list[int]] = []
    totals: list[int] = []  # tokens of each bin's sequences, unpadded
    for row in _decreasing(lengths):
        length = lengths[row]
        for index, members in enumerate(bins):
            # decreasing order: a bin's longest row is its first one
            longest = lengths[members[0]]
            cost = totals[index] + length if budget.packing else (len(members) + 1) * longest
            if cost <= budget.max_tokens:
                members.append(row)
                totals[index] += length
                break
        else:
            bins.append([row])
            totals.append(length)
    return bins


def micro_batches_at_full_length(num_rows: int, seq_length: int, budget: TokenBudget) -> int:
    """Micro-batches of ``num_rows`` sequences of ``seq_length`` tokens each (the most a step can need).

    Packed or padded alike, ``budget.max_tokens // seq_length`` such sequences share one micro-batch.
    """
    return -(-num_rows // max(budget.max_tokens // seq_length, 1))


def balanced_row_shards(lengths: Sequence[int], dp_size: int) -> list[list[int]]:
    """Rows of each data-parallel rank: ``B / dp_size`` each, balanced by tokens; ascending within a rank.

    Raises:
        ValueError: ``dp_size`` does not divide the number of rows.
    """
    if len(lengths) % dp_size:
        raise ValueError(f"batch of {len(lengths)} rows does not split over dp_size={dp_size}; see GTPOConfig.validate")
    share = len(lengths) // dp_size
    shards: list[list[int]] = [[] for _ in range(dp_size)]
    tokens = [0] * dp_size
    for row in _decreasing(lengths):
        rank = min((r for r in range(dp_size) if len(shards[r]) < share), key=lambda r: (tokens[r], r))
        shards[rank].append(row)
        tokens[rank] += lengths[row]
    return [sorted(rows) for rows in shards]


def dp_rows(lengths: Sequence[int], *, dp_size: int, dp_rank: int, by_tokens: bool) -> list[int]:
    """Rows of data-parallel rank ``dp_rank`` among rows of ``lengths`` tokens.

    Its contiguous ``B / dp_size`` share (:func:`row_shard`) or, under a token budget (``by_tokens``), its
    :func:`balanced_row_shards` share.

    Raises:
        ValueError: ``dp_size`` does not divide the number of rows.
    """
    if by_tokens:
        return balanced_row_shards(lengths, dp_size)[dp_rank]
    return list(range(len(lengths)))[row_shard(len(lengths), rank=dp_rank, size=dp_size)]
