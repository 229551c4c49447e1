"""Answer extraction, numeric parsing, equivalence and maj@k normalisation, on hand-written literal cases."""

from __future__ import annotations

from fractions import Fraction

import pytest

from gtpo_megatron.rewards.math_answer import (
    answers_match,
    extract_answer,
    extract_boxed,
    normalize_answer,
    parse_number,
    reference_answer,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("She has 3 + 4 = 7 apples.\n#### 1,234", "1234"),
        ("<reasoning>2*6</reasoning>\n<answer>\n12\n</answer>", "12"),
        ("<reasoning>x</reasoning><answer>The result is \\boxed{\\frac{1}{2}}</answer>", "\\frac{1}{2}"),
        ("so \\boxed{3} first, then \\boxed{\\sqrt{\\frac{a}{b}}}", "\\sqrt{\\frac{a}{b}}"),
        ("<answer>5</answer> and later <answer>6</answer>", "6"),
        ("Therefore, the answer is $42$.\n", "42"),
        ("The answer is 1,250 apples. Later 3 + 4 = 7.", "1250"),
        ("So, the answer is 1 + 1 = 2 apples.", "2"),
        ("The answer is 10 yes answers of the question. So 10 + 10 = 20", "10"),
        ("the answer is unclear. I think 9", "9"),
        ("the answer is: $\\frac{3}{4}$ so we stop at 9", "\\frac{3}{4}"),
        ("The answer is ten, not 12 or 13", "12"),
        ("She pays 3 dollars, then 1,250 dollars in total", "1250"),
        ("no digits at all", None),
        ("\\boxed{unclosed", None),
    ],
)
def test_extract_answer(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected


def test_extract_answer_without_fallback_needs_a_marker() -> None:
    assert extract_answer("the total is 12", fallback_last_number=False) is None
    assert extract_answer("the total is \\boxed{12}", fallback_last_number=False) == "12"


def test_extract_boxed_balances_nested_braces() -> None:
    assert extract_boxed("\\boxed{\\frac{\\sqrt{2}}{2}} tail") == "\\frac{\\sqrt{2}}{2}"
    assert extract_boxed("\\fbox{7}") == "7"
    assert extract_boxed("nothing") is None


def test_reference_answer() -> None:
    assert reference_answer("Natalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72") == "72"
    assert reference_answer("so the answer is $\\boxed{\\frac{14}{3}}$.") == "\\frac{14}{3}"
    assert reference_answer("  \\left( 3, \\frac{\\pi}{2} \\right) ") == "\\left( 3, \\frac{\\pi}{2} \\right)"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1,234", Fraction(1234)),
        ("$1,234.00", Fraction(1234)),
        ("\\$18", Fraction(18)),
        ("72 dollars", Fraction(72)),
        ("50\\%", Fraction(50)),
        ("-\\frac{3}{4}", Fraction(-3, 4)),
        ("\\dfrac{1}{2}", Fraction(1, 2)),
        ("1/2", Fraction(1, 2)),
        ("0.5", Fraction(1, 2)),
        ("\\boxed{7}", Fraction(7)),
        ("1,-2", None),
        ("5i", None),
        ("2x", None),
        ("3\\sqrt{2}", None),
        ("1/0", None),
    ],
)
def test_parse_number(text: str, expected: Fraction | None) -> None:
    assert parse_number(text) == expected


@pytest.mark.parametrize(
    ("pred", "ref", "expected"),
    [
        ("1,234", "1234", True),
        ("$1,234.00", "1234", True),
        ("72 dollars", "72", True),
        ("\\frac{1}{2}", "0.5", True),
        ("0.509", "0.5", True),  # within the paper's 1e-2
        ("0.52", "0.5", False),
        ("12", "13", False),
        ("033", "33", True),  # AIME answers are integers 0..999
        ("204", "204", True),
        ("\\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}", True),
        ("\\frac{\\sqrt{2}}{2}", "\\sqrt{2}", False),
        ("(3, \\pi/2)", "\\left( 3, \\frac{\\pi}{2} \\right)", True),
        ("-2, 1", "1,-2", True),
        ("6-5i", "6 - 5i", True),
        ("5i", "5", False),
        ("11\\sqrt{2}", "11\\sqrt2", True),
        ("\\text{(B)}", "B", True),
        ("B", "C", False),
        ("90", "90^\\circ", True),
        (None, "3", False),
        ("", "3", False),
    ],
)
def test_answers_match(pred: str | None, ref: str, expected: bool) -> None:
    assert answers_match(pred, ref) is expected


@pytest.mark.parametrize(
    ("texts", "canonical"),
    [
        (["1,234", "1234", "$1,234.00", "#### 1,234"], "1234"),
        (["\\frac{1}{2}", "0.5", "1/2", "\\boxed{\\dfrac{1}{2}}"], "1/2"),
        (["\\boxed{\\text{(B)}}", "B", "(B)", "b"], "B"),
        (["\\left( 3, \\frac{\\pi}{2} \\right)", "( 3,\\frac{\\pi}{2})"], "(3,\\frac{\\pi}{2})"),
        ([None, ""], ""),
    ],
)
def test_normalize_answer_groups_equal_answers(texts: list[str | None], canonical: str) -> None:
    assert {normalize_answer(t) for t in texts} == {canonical}


def test_normalize_answer_keeps_different_answers_apart() -> None:
    values = ["1/2", "0.25", "B", "C", "12", "-12", "\\sqrt{2}"]
    assert len({normalize_answer(v) for v in values}) == len(values)
