"""PromptLoader: per-epoch permutations and an identical data order after a state round trip."""

from __future__ import annotations

import json

import pytest

from gtpo_megatron.data import Problem, PromptLoader

PROBLEMS = [Problem(id=f"p{i}", question=f"q{i}?", answer=str(i), source="test") for i in range(10)]


def ids(batches: list[list[Problem]]) -> list[list[str]]:
    return [[p.id for p in batch] for batch in batches]


def test_each_epoch_is_a_permutation_with_a_new_order() -> None:
    loader = PromptLoader(PROBLEMS, batch_size=5, seed=7)
    epochs = [sum(ids([loader.next_batch(), loader.next_batch()]), []) for _ in range(3)]
    assert all(sorted(e) == sorted(p.id for p in PROBLEMS) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    assert loader.epoch == 3 and loader.num_consumed == 30
    same_seed = PromptLoader(PROBLEMS, batch_size=10, seed=7)
    assert ids([same_seed.next_batch()])[0] == epochs[0]
    assert ids([PromptLoader(PROBLEMS, batch_size=10, seed=8).next_batch()])[0] != epochs[0]


def test_no_shuffle_is_file_order_and_batches_cross_epochs() -> None:
    loader = PromptLoader(PROBLEMS, batch_size=4, shuffle=False)
    assert ids([loader.next_batch() for _ in range(3)]) == [
        ["p0", "p1", "p2", "p3"],
        ["p4", "p5", "p6", "p7"],
        ["p8", "p9", "p0", "p1"],
    ]
    assert loader.epoch == 1


@pytest.mark.parametrize("consumed_sizes", [[3, 3, 3], [4, 1, 9, 2], [10]])
def test_resume_sees_the_same_order(consumed_sizes: list[int]) -> None:
    original = PromptLoader(PROBLEMS, batch_size=3, seed=11)
    for size in consumed_sizes:
        original.next_batch(size)
    state = json.loads(json.dumps(original.state_dict()))
    expected = ids([original.next_batch() for _ in range(8)])
    resumed = PromptLoader(PROBLEMS, batch_size=3, seed=11)
    resumed.load_state_dict(state)
    iterator = iter(resumed)
    assert ids([next(iterator) for _ in range(8)]) == expected


def test_state_mismatch_and_bad_arguments_raise() -> None:
    state = PromptLoader(PROBLEMS, batch_size=2, seed=1).state_dict()
    with pytest.raises(ValueError, match="'seed': \\(1, 2\\)"):
        PromptLoader(PROBLEMS, batch_size=2, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="'num_problems': \\(10, 9\\)"):
        PromptLoader(PROBLEMS[:9], batch_size=2, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="out of range"):
        PromptLoader(PROBLEMS, batch_size=2, seed=1).load_state_dict({**state, "position": 10})
    with pytest.raises(ValueError, match="problems is empty"):
        PromptLoader([], batch_size=2)
    with pytest.raises(ValueError, match="batch_size=0"):
        PromptLoader(PROBLEMS, batch_size=0)
    with pytest.raises(ValueError, match="size=0"):
        PromptLoader(PROBLEMS, batch_size=1).next_batch(0)


def test_a_fork_draws_the_same_batches_on_its_own() -> None:
    loader = PromptLoader(PROBLEMS, batch_size=3, seed=7)
    loader.next_batch()
    ahead = loader.fork()
    drawn_ahead = ids([ahead.next_batch() for _ in range(4)])  # across the epoch boundary
    assert loader.state_dict()["position"] == 3  # the original did not move
    assert ids([loader.next_batch() for _ in range(4)]) == drawn_ahead
    assert ahead.state_dict() == loader.state_dict()
