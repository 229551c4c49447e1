"""pass@k against exact binomial fractions and hand values; maj@k voting, ties and normalisation; aggregation."""

from __future__ import annotations

from fractions import Fraction
from math import comb

import pytest

from gtpo_megatron.evaluation.metrics import SampleRecord, aggregate, maj_at_k, majority_answer, pass_at_k
from gtpo_megatron.rewards.math_answer import normalize_answer


def exact_pass_at_k(n: int, c: int, k: int) -> Fraction:
    """Independent reference: the textbook formula in exact rational arithmetic."""
    return 1 - Fraction(comb(n - c, k), comb(n, k))


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (4, 1, 1, 0.25),          # c / n
        (4, 1, 2, 0.5),           # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (5, 2, 3, 0.9),           # 1 - C(3,3)/C(5,3) = 1 - 1/10
        (10, 3, 2, 8 / 15),       # 1 - C(7,2)/C(10,2) = 1 - 21/45
        (4, 1, 4, 1.0),           # n = k with one correct
        (4, 0, 4, 0.0),           # n = k, none correct
        (64, 0, 1, 0.0),          # c = 0
        (64, 0, 64, 0.0),
        (8, 8, 1, 1.0),           # all correct
        (8, 5, 4, 1.0),           # n - c < k: every k-subset holds a correct one
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
    return [SampleRecord(normalize_answer(a), ok, False, 10, False) for a, ok in zip(answers, correct)]


def test_majority_vote_and_first_appearance_tie_break():
    assert majority_answer(["3", "2", "2", "3"]) == 0  # 2-2 tie: "3" appears first
    assert majority_answer(["2", "3", "3", "2"]) == 0
    assert majority_answer(["", "7", "", "8", "8"]) == 3  # "" never votes
    assert majority_answer(["", ""]) is None
    # tie between "2" (correct) and "3" (wrong): the first-appearing answer decides
    assert maj_at_k(samples(["2", "3", "3", "2"], [True, False, False, True]), 4) == 1.0
    assert maj_at_k(samples(["3", "2", "2", "3"], [False, True, True, False]), 4) == 0.0


def test_maj_at_k_uses_first_k_samples_only():
    s = samples(["1", "2", "2", "2"], [True, False, False, False])
    assert maj_at_k(s, 1) == 1.0
    assert maj_at_k(s, 2) == 1.0  # 1-1 tie, "1" first
    assert maj_at_k(s, 3) == 0.0
    assert maj_at_k(samples(["", ""], [False, False]), 2) == 0.0  # nobody voted
    with pytest.raises(ValueError, match="k=3"):
        maj_at_k(s[:2], 3)


def test_equivalent_answers_share_one_vote():
    # "1,234" = "1234"; "\frac{1}{2}" = "0.5" = "1/2"; "\boxed{\text{(B)}}" = "B"
    assert normalize_answer("1,234") == normalize_answer("1234")
    assert normalize_answer("\\frac{1}{2}") == normalize_answer("0.5") == normalize_answer("1/2")
    assert normalize_answer("\\boxed{\\text{(B)}}") == normalize_answer("B")
    s = samples(["3", "3", "\\frac{1}{2}", "0.5", "1/2"], [False, False, True, True, True])
    assert maj_at_k(s, 5) == 1.0  # three votes for 1/2 beat two for 3


def test_aggregate_by_hand():
    p1 = [SampleRecord("5", True, True, 10, False), SampleRecord("4", False, True, 20, True)]
    p2 = [SampleRecord("", False, False, 30, True), SampleRecord("", False, False, 40, False)]
    out = aggregate([p1, p2], ks=(1, 2))
    assert out["pass@1"] == pytest.approx((0.5 + 0.0) / 2)
    assert out["pass@2"] == pytest.approx((1.0 + 0.0) / 2)
    assert out["maj@1"] == pytest.approx(0.5)  # p1's first answer is correct; p2 has no vote
    assert out["maj@2"] == pytest.approx(0.5)  # p1: 1-1 tie -> "5" (first) is correct
    assert out["accuracy"] == 0.25 and out["format_rate"] == 0.5 and out["truncation_rate"] == 0.5
    assert out["mean_length"] == 25.0 and out["num_problems"] == 2 and out["num_samples"] == 2
    with pytest.raises(ValueError, match="same number of samples"):
        aggregate([p1, p1[:1]], ks=(1,))
    with pytest.raises(ValueError, match="at least one problem"):
        aggregate([], ks=(1,))
