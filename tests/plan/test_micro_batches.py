"""Token-budget planners (``plan.micro_batches``): exact bins and shards on small cases, invariants on random ones."""

from __future__ import annotations

import random

import pytest

from gtpo_megatron.plan.micro_batches import TokenBudget, balanced_row_shards, plan_micro_batches


def test_micro_batches_packed_first_fit_decreasing():
    # decreasing: rows 2 (8), 0 (5), 1 (3), 3 (2); 5 does not join 8 (13 > 10), 3 joins 5, 2 joins 8 (10 <= 10)
    assert plan_micro_batches([5, 3, 8, 2], TokenBudget(max_tokens=10, packing=True)) == [[2, 3], [0, 1]]


def test_micro_batches_padded_cost_is_rows_times_longest():
    # 5 next to 8 costs 2 * 8 = 16 > 10; 3 next to 5 costs 10; 2 fits nowhere (16, 15)
    assert plan_micro_batches([5, 3, 8, 2], TokenBudget(max_tokens=10)) == [[2], [0, 1], [3]]
    assert TokenBudget(max_tokens=10).cost([5, 3]) == 10
    assert TokenBudget(max_tokens=10, packing=True).cost([5, 3]) == 8


@pytest.mark.parametrize("packing", [False, True])
def test_micro_batches_every_row_once_under_the_budget(packing: bool):
    rng = random.Random(0)
    budget = TokenBudget(max_tokens=700, packing=packing)
    for _ in range(50):
        lengths = [rng.choice([0, rng.randint(3, 700), rng.randint(3, 80)]) for _ in range(rng.randint(1, 40))]
        bins = plan_micro_batches(lengths, budget)
        assert sorted(row for rows in bins for row in rows) == list(range(len(lengths)))
        assert all(budget.cost([lengths[r] for r in rows]) <= budget.max_tokens for rows in bins)
        assert all([lengths[r] for r in rows] == sorted((lengths[r] for r in rows), reverse=True) for rows in bins)
        # first fit: no bin could have taken the first row of any later bin
        for later, rows in enumerate(bins):
            for earlier in bins[:later]:
                assert budget.cost([lengths[r] for r in [*earlier, rows[0]]]) > budget.max_tokens


def test_micro_batches_zero_length_rows_and_empty_batches():
    assert plan_micro_batches([], TokenBudget(max_tokens=4)) == []
    assert plan_micro_batches([0, 4, 0], TokenBudget(max_tokens=4, packing=True)) == [[1, 0, 2]]


def test_micro_batches_refuse_a_sequence_over_the_budget():
    with pytest.raises(ValueError, match=r"a sequence of 11 tokens .* exceeds optim.max_tokens_per_micro_batch=10"):
        plan_micro_batches([3, 11], TokenBudget(max_tokens=10, packing=True))
    with pytest.raises(ValueError, match=r"optim.max_tokens_per_micro_batch=0 must be >= 1"):
        TokenBudget(max_tokens=0)


def test_row_shards_balance_tokens_with_equal_row_counts():
    assert balanced_row_shards([10, 1, 1, 10], 2) == [[0, 1], [2, 3]]
    assert balanced_row_shards([9, 8, 1, 1], 2) == [[0, 3], [1, 2]]
    # rank 0 fills its 3 rows first; the last short row must go to rank 1 whatever its tokens
    assert balanced_row_shards([5, 4, 3, 0, 0, 0], 2) == [[0, 3, 4], [1, 2, 5]]
    assert balanced_row_shards([3, 1, 2], 1) == [[0, 1, 2]]


def test_row_shards_are_a_partition_and_closer_than_contiguous_shares():
    rng = random.Random(1)
    lengths = sorted(rng.randint(20, 400) for _ in range(32))  # a worst case for contiguous shares
    shards = balanced_row_shards(lengths, 4)
    assert sorted(row for rows in shards for row in rows) == list(range(32))
    assert {len(rows) for rows in shards} == {8}
    spread = [sum(lengths[r] for r in rows) for rows in shards]
    contiguous = [sum(lengths[8 * k : 8 * k + 8]) for k in range(4)]
    assert max(spread) - min(spread) <= max(lengths)
    assert max(spread) - min(spread) < (max(contiguous) - min(contiguous)) / 10


def test_row_shards_refuse_an_uneven_split():
    with pytest.raises(ValueError, match="batch of 5 rows does not split over dp_size=2"):
        balanced_row_shards([1] * 5, 2)
