"""pass@k against exact binomial fractions and hand values; maj@k classes and ties; aggregation."""

from __future__ import annotations

from fractions import Fraction
from math import comb

import pytest

from gtpo_megatron.evaluation.metrics import SampleRecord, aggregate, answer_classes, maj_at_k, pass_at_k
from gtpo_megatron.rewards.math_answer import same_answer


def exact_pass_at_k(n: int, c: int, k: int) -> Fraction:
    """Independent reference: the textbook formula in exact rational arithmetic."""
    return 1 - Fraction(comb(n - c, k), comb(n, k))


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (4, 1, 1, 0.25),  # c / n
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (5, 2, 3, 0.9),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
        (10, 3, 2, 8 / 15),  # 1 - C(7,2)/C(10,2) = 1 - 21/45
        (4, 1, 4, 1.0),  # n = k with one correct
        (4, 0, 4, 0.0),  # n = k, none correct
        (64, 0, 1, 0.0),  # c = 0
        (64, 0, 64, 0.0),
        (8, 8, 1, 1.0),  # all correct
        (8, 5, 4, 1.0),  # n - c < k: every k-subset holds a correct one
    ],
)
def test_pass_at_k_hand_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-15)


def test_pass_at_k_matches_exact_fractions_for_large_n():
    for n, c, k in [(64, 3, 16), (64, 1, 32), (64, 63, 64), (1024, 7, 500), (1024, 1, 1), (1024, 100, 1024)]:
        assert pass_at_k(n, c, k) == pytest.approx(float(exact_pass_at_k(n, c, k)), rel=1e-12, abs=1e-15)


@pytest.mark.parametrize(("n", "c", "k"), [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)])
def test_pass_at_k_rejects_bad_counts(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def samples(answers: list[str], correct: list[bool]) -> list[SampleRecord]:
    return [SampleRecord(a, ok, False, 10, False) for a, ok in zip(answers, correct)]


def text_equal(first: str, second: str) -> bool:
    return first == second


def test_tie_counts_the_fraction_of_correct_tied_classes_whatever_the_order():
    """Gold 9: votes [9, 9, 5, 5] and [5, 5, 9, 9] both give 1/2 (first-appearance tie-breaking gave 1 and 0)."""
    for answers in (["9", "9", "5", "5"], ["5", "5", "9", "9"], ["9", "5", "9", "5"]):
        assert maj_at_k(samples(answers, [a == "9" for a in answers]), 4, text_equal) == 0.5
    three_way = ["1", "2", "3", "1", "2", "3"]
    assert maj_at_k(samples(three_way, [a == "2" for a in three_way]), 6, text_equal) == pytest.approx(1 / 3)


def test_votes_count_equivalence_classes_not_strings():
    """Gold \\frac{\\sqrt{3}}{3}: [2, \\frac{\\sqrt{3}}{3}, \\sqrt{3}/3, 7] -> the class of the two forms wins."""
    answers = ["2", "\\frac{\\sqrt{3}}{3}", "\\sqrt{3}/3", "7"]
    correct = [False, True, True, False]
    assert maj_at_k(samples(answers, correct), 4, same_answer) == 1.0
    assert maj_at_k(samples(answers, correct), 4, text_equal) == 0.5  # 4 classes of one vote, 2 right
    assert answer_classes(samples(answers, correct), same_answer) == [0, 1, 1, 2]


def test_classes_are_transitive_and_never_mix_verdicts():
    def same(a: str, b: str) -> bool:  # a chain a~b~c without a~c, and a wrong answer "equal" to a right one
        return {a, b} in ({"a", "b"}, {"b", "c"}, {"c", "x"})

    classes = answer_classes(samples(["c", "x", "a", "b", ""], [True, False, True, True, False]), same)
    assert classes == [0, 1, 0, 0, -1]


def test_maj_at_k_uses_first_k_samples_only():
    s = samples(["1", "2", "2", "2"], [True, False, False, False])
    assert maj_at_k(s, 1, text_equal) == 1.0
    assert maj_at_k(s, 2, text_equal) == 0.5  # 1-1 tie
    assert maj_at_k(s, 3, text_equal) == 0.0
    assert maj_at_k(samples(["", ""], [False, False]), 2, text_equal) == 0.0  # nobody voted
    assert maj_at_k(samples(["", "3"], [False, True]), 2, text_equal) == 1.0  # "" never votes
    with pytest.raises(ValueError, match="k=3"):
        maj_at_k(s[:2], 3, text_equal)


def test_aggregate_by_hand():
    p1 = [SampleRecord("5", True, True, 10, False), SampleRecord("4", False, True, 20, True)]
    p2 = [SampleRecord("", False, False, 30, True), SampleRecord("", False, False, 40, False)]
    out = aggregate([p1, p2], ks=(1, 2), same=[text_equal, text_equal])
    assert out["pass@1"] == pytest.approx((0.5 + 0.0) / 2)
    assert out["pass@2"] == pytest.approx((1.0 + 0.0) / 2)
    assert out["maj@1"] == pytest.approx(0.5)  # p1's first answer is correct; p2 has no vote
    assert out["maj@2"] == pytest.approx(0.25)  # p1: 1-1 tie between right "5" and wrong "4" -> 1/2
    assert out["accuracy"] == 0.25 and out["format_rate"] == 0.5 and out["truncation_rate"] == 0.5
    assert out["mean_length"] == 25.0 and out["num_problems"] == 2 and out["num_samples"] == 2
    with pytest.raises(ValueError, match="same number of samples"):
        aggregate([p1, p1[:1]], ks=(1,), same=[text_equal, text_equal])
    with pytest.raises(ValueError, match="at least one problem"):
        aggregate([], ks=(1,), same=[])
