"""Built-in GSM8K-style arithmetic word problems: the default task, generated locally (no download).

Problem ``i`` of ``(seed, split, difficulty)`` has its own ``random.Random`` stream (independent of the count, the
platform and ``PYTHONHASHSEED``). Answers are non-negative integers ("Mia has 7 marbles. She finds 5 more
marbles. How many marbles does Mia have now?" -> "12"). Levels: ``easy`` (default; one addition in 2..10, which
SmolLM2-135M gets partly right), ``medium`` (one + or - in 2..50), ``hard`` (two steps of +, -, * in 2..100), or
a custom :class:`SyntheticLevel`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from gtpo_megatron.data.types import Problem

_NAMES = (
    ("Mia", "She"),
    ("Noah", "He"),
    ("Ava", "She"),
    ("Liam", "He"),
    ("Zoe", "She"),
    ("Omar", "He"),
    ("Lena", "She"),
    ("Ravi", "He"),
)
_ITEMS = ("apples", "marbles", "stickers", "books", "pencils", "cookies", "shells", "coins", "cards", "stamps")
_FRIENDS = ("a friend", "a cousin", "a neighbour", "a classmate", "a teacher")
_ADD = (
    "{pronoun} buys {n} more {item}.",
    "{pronoun} finds {n} more {item}.",
    "{friend_cap} gives {name} {n} more {item}.",
    "{pronoun} gets {n} more {item} as a gift.",
)
_SUB = (
    "{pronoun} gives {n} {item} to {friend}.",
    "{pronoun} loses {n} {item}.",
    "{pronoun} sells {n} {item}.",
    "{pronoun} uses {n} of the {item}.",
)
_MUL = (
    "Then the number of {item} {name} has becomes {n} times as large.",
    "{pronoun} collects more until {pronoun_lower} has {n} times as many {item} as before.",
)


@dataclass(frozen=True, slots=True)
class SyntheticLevel:
    """A difficulty level: ``num_steps`` operations on amounts in 2..``max_value``; ``*`` uses factors 2..5."""

    num_steps: int
    max_value: int
    operations: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.num_steps < 1 or self.max_value < 1:
            raise ValueError(f"num_steps={self.num_steps} and max_value={self.max_value} must both be >= 1")
        if not self.operations or set(self.operations) - {"+", "-", "*"}:
            raise ValueError(f"operations={self.operations!r} must be a non-empty subset of ('+', '-', '*')")


SYNTHETIC_LEVELS: dict[str, SyntheticLevel] = {
    "easy": SyntheticLevel(num_steps=1, max_value=10, operations=("+",)),
    "medium": SyntheticLevel(num_steps=1, max_value=50, operations=("+", "-")),
    "hard": SyntheticLevel(num_steps=2, max_value=100, operations=("+", "-", "*")),
}


def _step(rng: random.Random, level: SyntheticLevel, total: int, words: dict[str, str]) -> tuple[str, int]:
    """One sentence and the new total; subtraction never goes below zero (falls back to addition at 0)."""
    low = min(2, level.max_value)  # plural nouns read naturally with amounts >= 2
    operation = rng.choice(level.operations)
    if operation == "-" and total == 0:
        operation = "+"
    if operation == "*":
        n = rng.randint(2, 5)
        return rng.choice(_MUL).format(n=n, **words), total * n
    if operation == "-":
        n = rng.randint(min(low, total), min(total, level.max_value))
        return rng.choice(_SUB).format(n=n, **words), total - n
    n = rng.randint(low, level.max_value)
    return rng.choice(_ADD).format(n=n, **words), total + n


def make_problem(index: int, *, seed: int, split: str, level: SyntheticLevel, level_name: str) -> Problem:
    """Problem number ``index`` of the stream ``(seed, split, level_name)``."""
    rng = random.Random(f"gtpo-synthetic/{level_name}/{split}/{seed}/{index}")
    name, pronoun = rng.choice(_NAMES)
    friend = rng.choice(_FRIENDS)
    words = {
        "name": name,
        "pronoun": pronoun,
        "pronoun_lower": pronoun.lower(),
        "item": rng.choice(_ITEMS),
        "friend": friend,
        "friend_cap": friend[0].upper() + friend[1:],
    }
    total = rng.randint(min(2, level.max_value), level.max_value)
    sentences = [f"{name} has {total} {words['item']}."]
    for _ in range(level.num_steps):
        sentence, total = _step(rng, level, total, words)
        sentences.append(sentence)
    sentences.append(f"How many {words['item']} does {name} have now?")
    return Problem(
        id=f"synthetic-{level_name}-{split}-{seed}-{index}",
        question=" ".join(sentences),
        answer=str(total),
        source="synthetic",
    )


def generate_problems(
    num: int, *, seed: int = 0, split: str = "train", difficulty: str | SyntheticLevel = "easy"
) -> list[Problem]:
    """The first ``num`` problems of the stream ``(seed, split, difficulty)``.

    Raises:
        ValueError: if ``num < 0``, ``split`` is not train/test, or ``difficulty`` is an unknown level name.
    """
    if num < 0:
        raise ValueError(f"num={num} must be >= 0")
    if split not in ("train", "test"):
        raise ValueError(f"split={split!r} must be 'train' or 'test' for the synthetic task")
    if isinstance(difficulty, SyntheticLevel):
        level, level_name = (
            difficulty,
            "custom-{}-{}-{}".format(difficulty.num_steps, difficulty.max_value, "".join(difficulty.operations)),
        )
    elif difficulty in SYNTHETIC_LEVELS:
        level, level_name = SYNTHETIC_LEVELS[difficulty], difficulty
    else:
        raise ValueError(f"difficulty={difficulty!r} is unknown; choose one of {sorted(SYNTHETIC_LEVELS)}")
    return [make_problem(i, seed=seed, split=split, level=level, level_name=level_name) for i in range(num)]
