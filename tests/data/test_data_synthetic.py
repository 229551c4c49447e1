"""The built-in arithmetic task: determinism, ranges, and answers checked by an independent sentence parser."""

from __future__ import annotations

import re

import pytest

from gtpo_megatron.data import SYNTHETIC_LEVELS, SyntheticLevel, generate_problems


def solve(question: str) -> int:
    """Independent reference: reads the story sentence by sentence and applies the operation each verb names."""
    sentences = [s for s in re.split(r"(?<=[.?])\s+", question) if s]
    total = int(re.search(r" has (\d+) ", sentences[0]).group(1))
    for sentence in sentences[1:-1]:
        n = int(re.search(r"\d+", sentence).group())
        if "times" in sentence:
            total *= n
        elif "more" in sentence:
            total += n
        elif re.search(r"\b(gives \d+ \w+ to|loses|sells|uses)\b", sentence):
            total -= n
        else:
            raise AssertionError(f"unknown sentence {sentence!r}")
    assert sentences[-1].startswith("How many")
    return total


def test_easy_is_one_small_addition() -> None:
    problems = generate_problems(200, seed=0)
    for p in problems:
        numbers = [int(x) for x in re.findall(r"\d+", p.question)]
        assert len(numbers) == 2 and all(2 <= x <= 10 for x in numbers)
        assert int(p.answer) == sum(numbers) == solve(p.question)
    assert len({p.question for p in problems}) > 150
    assert len({p.answer for p in problems}) > 10


@pytest.mark.parametrize("difficulty", sorted(SYNTHETIC_LEVELS))
def test_every_level_answer_matches_the_reference_solver(difficulty: str) -> None:
    for p in generate_problems(300, seed=5, split="test", difficulty=difficulty):
        assert p.answer == str(solve(p.question)) and int(p.answer) >= 0


def test_hard_uses_all_operations() -> None:
    text = " ".join(p.question for p in generate_problems(200, difficulty="hard"))
    assert "times" in text and "more" in text and re.search(r"gives|loses|sells|uses", text)


def test_streams_are_deterministic_prefix_stable_and_split_apart() -> None:
    assert generate_problems(50, seed=1)[:5] == generate_problems(5, seed=1)
    assert generate_problems(20, seed=1) != generate_problems(20, seed=2)
    train = {p.question for p in generate_problems(20, seed=1, split="train")}
    test = {p.question for p in generate_problems(20, seed=1, split="test")}
    assert train != test
    assert generate_problems(3, seed=1)[2].id == "synthetic-easy-train-1-2"


def test_custom_level_and_errors() -> None:
    level = SyntheticLevel(num_steps=3, max_value=4, operations=("*",))
    for p in generate_problems(20, difficulty=level):
        assert p.answer == str(solve(p.question))
    with pytest.raises(ValueError, match="difficulty='insane' is unknown"):
        generate_problems(1, difficulty="insane")
    with pytest.raises(ValueError, match="split='dev'"):
        generate_problems(1, split="dev")
    with pytest.raises(ValueError, match="operations=\\('/',\\)"):
        SyntheticLevel(num_steps=1, max_value=5, operations=("/",))
    with pytest.raises(ValueError, match="num_steps=0"):
        SyntheticLevel(num_steps=0, max_value=5, operations=("+",))
