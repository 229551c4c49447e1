"""Grading on hand-written completions: where the answer is, the strict and lenient modes, answer notations
(text-mode dollars, emphasis, lists joined by words, digit groups, decimal commas, times), numeric equivalence
and the vote equivalence ``same_answer`` (rules in docs/rewards.md)."""

from __future__ import annotations

import pytest

from gtpo_megatron.rewards.answer_text import is_bare
from gtpo_megatron.rewards.equivalence import parse_span
from gtpo_megatron.rewards.math_answer import Verdict, extract, grade, same_answer

HASH_TAIL = "9+8=17\n#### 17\n\nHope that helps with your 2 questions!"
PMATRIX = "\\begin{pmatrix} 3 \\\\ -4 \\end{pmatrix}"


@pytest.mark.parametrize(
    ("reference", "completion", "correct"),
    [
        ("7", "The code word is XQ7BZ.", False),  # digits inside a word are not an answer
        ("12", "Room B12 is free.", False),
        ("5", "The solution set is $(0,5]$.", False),  # an interval, not the number 5
        ("(0,5]", "The solution set is $(0,5]$.", True),
        ("456", "#### 4,56", False),  # 4,56 is no thousands group
        ("1250", "#### 12,50", False),
        ("1234", "#### 1,234", True),
        ("1234567", "\\boxed{1,234,567}", True),
        ("3.25", "#### 3.25,10.5", False),  # two numbers, not one
        ("10.5", "#### 3.25,10.5", False),
        ("3.2510.5", "#### 3.25,10.5", False),
        ("3.25, 10.5", "#### 3.25,10.5", True),
        ("4", "Thus $y = \\frac{3+\\sqrt{7}}{4}$.", False),  # a denominator is not the answer
        ("\\frac{3+\\sqrt{7}}{4}", "Thus $y = \\frac{3+\\sqrt{7}}{4}$.", True),
        ("5", "So the ratio is 2/5.", False),
        ("2/5", "So the ratio is 2/5.", True),
        ("\\frac{2}{5}", "So the ratio is 2/5.", True),
        ("0.4", "So the ratio is 2/5.", True),
        ("(3,-2)", "The final answer is (3, -2). I hope it is correct.", True),
        ("3", "The final answer is (3, -2). I hope it is correct.", False),
        ("(-2,3)", "The final answer is (3, -2). I hope it is correct.", False),
        ("12500", "The total is \\boxed{12,\\! 500}.", True),
        ("1000000", "The total is \\boxed{1,\\!000,\\!000}.", True),
        (PMATRIX, "\\boxed{\\begin{pmatrix}3\\\\-4\\end{pmatrix}}", True),  # \\ row break kept
        (PMATRIX, "\\boxed{\\begin{pmatrix}3\\\\4\\end{pmatrix}}", False),
        ("17", HASH_TAIL, True),  # the number right after ####
        ("2", HASH_TAIL, False),
        ("42", "#### 42 apples\nNext time bring 7.", True),
        ("58", "<answer>**58**</answer>", True),  # Markdown emphasis around the answer
        ("58", "<reasoning>r</reasoning>\n<answer>\n__58__\n</answer>", True),
        ("72", "Natalia sold 48/2 = 24 clips.\n#### 72", True),
        ("\\frac{\\sqrt{2}}{2}", "<answer>\\sqrt{2}/2</answer>", True),
        ("B", "\\boxed{\\text{(B)}}", True),
        ("C", "\\boxed{\\text{(B)}}", False),
    ],
)
def test_extraction_kind(reference: str, completion: str, correct: bool) -> None:
    """Raw-text cases need the lenient mode (strict gives them 0, see below)."""
    assert grade(completion, reference, extraction="lenient").correct is correct


@pytest.mark.parametrize(
    ("completion", "strict", "lenient"),
    [
        ("Maybe 12, maybe 30.", False, True),
        ("30", False, True),
        ("so we get $30$", False, True),
        ("\\boxed{30}", True, True),
        ("<answer>30</answer>", True, True),
        ("The final answer is 30.", True, True),
        ("Final Answer: the final answer for the count is 30", True, True),  # math-verify's own anchor
        ("<think>so it is \\boxed{30}", False, False),  # cut off inside <think>
        ("<think>maybe \\boxed{12}</think>So \\boxed{30}", True, True),
        ("<think>so it is 30</think>", False, False),  # an answer only inside the thoughts
    ],
)
def test_strictness(completion: str, strict: bool, lenient: bool) -> None:
    """Strict (MATH/AIME/AMC) needs \\boxed{}, <answer> or a final-answer statement; lenient (GSM8K) not."""
    assert grade(completion, "30", extraction="strict").correct is strict
    assert grade(completion, "30", extraction="lenient").correct is lenient


def test_no_answer_is_none_and_bad_modes_are_refused() -> None:
    assert grade("Maybe 12, maybe 30.", "30") == Verdict(False, None)
    assert extract("<think>\\boxed{3}", "lenient") == []
    with pytest.raises(ValueError, match="extraction='loose'"):
        grade("\\boxed{1}", "1", extraction="loose")
    with pytest.raises(ValueError, match="reference 'see the figure' holds no answer math-verify can read"):
        grade("\\boxed{1}", "see the figure")


@pytest.mark.parametrize(
    ("reference", "answer", "correct"),
    [
        ("\\frac{1}{3^{40}}", "\\frac{1}{3^{41}}", False),  # math-verify alone: equal (|a - b| < 1e-15)
        ("\\frac{1}{3^{40}}", "\\frac{1}{3^{40}}", True),
        ("\\frac{1}{3^{40}}", "3^{-40}", True),
        ("10^{-20}", "2 \\cdot 10^{-20}", False),
        ("10^{20}+1", "10^{20}", False),  # exact, not relative, for two rationals
        ("(\\frac{1}{3^{40}}, 1)", "(\\frac{1}{3^{41}}, 1)", False),  # nested: compared to 1e-50
        ("\\frac{\\sqrt{3}}{3}", "\\sqrt{3}/3", True),
        ("\\frac{\\sqrt{3}}{3}", "\\frac{1}{\\sqrt{3}}", True),
        ("\\frac{\\sqrt{3}}{3}", "0.5773502692", True),  # relative 1e-6 for irrationals and decimals
        ("\\frac{\\sqrt{3}}{3}", "0.577", False),
        ("\\frac{1}{12}", "0.0833333333333333", True),
        ("\\sqrt{2} \\cdot 10^{-40}", "\\sqrt{3} \\cdot 10^{-40}", False),
        ("0.5", "0.509", False),  # the paper's 1e-2 applies only to the paper reward (test_rewards_registry)
        ("28\\%", "28", True),  # percentages stay with math-verify
    ],
)
def test_numeric_equivalence(reference: str, answer: str, correct: bool) -> None:
    """Exact rationals, relative tolerance otherwise, math-verify for structures."""
    assert grade(f"\\boxed{{{answer}}}", reference).correct is correct


def test_paper_decimal_tolerance_is_for_plain_decimals_only() -> None:
    assert grade("#### 0.509", "0.5", decimal_abs_tol=1e-2).correct
    assert not grade("#### 0.52", "0.5", decimal_abs_tol=1e-2).correct
    assert grade("#### 1,234.004", "1234", decimal_abs_tol=1e-2).correct
    assert not grade("\\boxed{\\frac{1}{3^{41}}}", "\\frac{1}{3^{40}}", decimal_abs_tol=1e-2).correct


@pytest.mark.parametrize(
    ("first", "second", "same"),
    [
        ("\\frac{\\sqrt{3}}{3}", "\\sqrt{3}/3", True),
        ("\\sqrt{3}/3", "\\frac{\\sqrt{3}}{3}", True),
        ("2", "\\frac{\\sqrt{3}}{3}", False),
        ("1,234", "1234", True),
        ("9", "9.0", True),
        ("x = 5", "5", True),  # either direction of the reward's (asymmetric) equivalence
        ("5", "x = 5", True),
        ("\\frac{1}{3^{40}}", "\\frac{1}{3^{41}}", False),
        ("(3, -2)", "(-2, 3)", False),
    ],
)
def test_same_answer(first: str, second: str, same: bool) -> None:
    assert same_answer(first, second) is same


def test_spans_without_prose_are_one_latex_expression() -> None:
    assert is_bare("(3, -2)") and is_bare("\\text{(B)}") and is_bare(PMATRIX) and is_bare("odd")
    assert not is_bare("18 dollars") and not is_bare("$5$") and not is_bare("\\boxed{5}")
    assert parse_span("") == []


@pytest.mark.parametrize(
    ("reference", "completion", "correct"),
    [
        ("\\$18.90", "\\boxed{18.90}", True),  # MATH-500 golds in text-mode dollars
        ("\\$18.90", "\\boxed{18.9}", True),
        ("\\$36", "\\boxed{36}", True),
        ("\\$36", "\\boxed{35}", False),
        ("\\$32,\\!348", "\\boxed{32,348}", True),
        ("\\$32,\\!348", "\\boxed{32348}", True),
        ("36", "<answer>\\$36</answer>", True),
        ("36", "#### \\$36", True),
        ("36", "\\boxed{\\$36}", True),
        ("1000", "#### \\$1,000 in all", True),
        ("18.9", "So the total is \\$18.90.\nThe answer is \\$18.90.", True),
    ],
)
def test_text_mode_dollars_are_no_delimiters(reference: str, completion: str, correct: bool) -> None:
    assert grade(completion, reference).correct is correct


@pytest.mark.parametrize(
    ("reference", "completion", "correct"),
    [
        ("1331 and 1728", "\\boxed{1728}", False),  # a list is not its last number
        ("1331 and 1728", "\\boxed{1331}", False),
        ("1331 and 1728", "\\boxed{1331, 1728}", True),
        ("1331 and 1728", "\\boxed{1728, 1331}", True),
        ("1331 and 1728", "\\boxed{1331 \\text{ and } 1728}", True),
        ("1331 and 1728", "<answer>1331 and 1728</answer>", True),
        ("1728", "<answer>1331 and 1728</answer>", False),  # nor is a hedged answer
        ("1728", "#### 1331 or 1728", False),
        ("2 or 3", "\\boxed{3, 2}", True),
        ("1, 2, and 3", "\\boxed{3, 2, 1}", True),
    ],
)
def test_lists_joined_by_words(reference: str, completion: str, correct: bool) -> None:
    assert grade(completion, reference).correct is correct


@pytest.mark.parametrize(
    "completion",
    [
        "We get 2*234 = 468.\nFinal Answer: **73**",
        "Final Answer: **73**.",
        "**Final Answer: 73**",
        "The answer is **73**.",
        "Answer: *73*",
        "Answer: __73__",
        "Final answer: ***73***",
        "Answer: **x = 73**",
        "<answer>**73**</answer>",
    ],
)
def test_markdown_emphasis_in_strict_extraction(completion: str) -> None:
    assert grade(completion, "73", extraction="strict") == Verdict(True, "73")


@pytest.mark.parametrize(
    ("reference", "completion", "extraction", "correct"),
    [
        ("$12:00$", "$12:00$", "lenient", True),  # 12:00 reads as 12/0: compared as written
        ("$12:00$", "\\boxed{12:00}", "strict", True),
        ("$12:00$", "$1:00$", "lenient", False),
        ("$12:00$", "\\boxed{1:00}", "strict", False),
        ("$12:00$", "\\boxed{12}", "strict", False),
        ("12:00", "\\boxed{12:00}", "strict", True),
        ("\\frac{1}{0}", "\\boxed{\\frac{1}{0}}", "strict", True),
        ("\\frac{1}{0}", "\\boxed{\\frac{2}{0}}", "strict", False),
    ],
)
def test_answers_without_a_finite_value(reference: str, completion: str, extraction: str, correct: bool) -> None:
    assert grade(completion, reference, extraction=extraction).correct is correct


def test_votes_on_answers_without_a_finite_value() -> None:
    assert same_answer("12:00", "12:00 ") and not same_answer("12:00", "1:00")


@pytest.mark.parametrize(
    ("reference", "completion", "correct"),
    [
        ("1000", "\\boxed{1 000}", True),  # digit groups: math-verify's number reading
        ("1000", "\\boxed{1\\,000}", True),
        ("1000", "\\boxed{1~000}", True),
        ("1000000", "\\boxed{1 000 000}", True),
        ("1000.5", "\\boxed{1 000.5}", True),
        ("0", "\\boxed{1 000}", False),  # not LaTeX's product 1*000
        ("1 000", "\\boxed{1000}", True),
        ("1000", "#### 1 000", True),
        ("1000", "#### 1 000 apples", True),
        ("1000.99", "\\boxed{1000,99}", True),  # a decimal comma
        ("1,22", "\\boxed{1.22}", True),
        ("1,22", "\\boxed{122}", False),  # never 122
        ("1,22", "\\boxed{1, 22}", True),  # and still the list 1, 22
        ("-2,1", "\\boxed{1,-2}", True),  # the MATH-500 list gold stays a list
        ("0,111", "\\boxed{0.111}", True),
        ("1,234", "\\boxed{1.234}", False),  # three digits after the comma: a thousands group
        ("12,5", "\\boxed{125}", False),
    ],
)
def test_number_formats(reference: str, completion: str, correct: bool) -> None:
    assert grade(completion, reference).correct is correct


# math-verify's own number cases expected 1 (huggingface/Math-Verify tests/test_all.py::test_number_extraction; its
# "AZYUK2A" case is XQ7BZ above), as raw text (lenient) and as a #### line.
MATH_VERIFY_NUMBERS = [
    ("-5", "-5"),
    ("7425000", "7,425,000"),
    ("1000", "1 000"),
    ("1000", "1000.0"),
    ("1000.0", "1,000.0"),
    ("1000.99", "1000,99"),
    ("1,22", "1.22"),
    ("2.74", "Soucis : 2,74 $ a.."),
    ("0.4", ".4"),
    ("1000.99", "1,000.99"),
    ("1000.99", "$1,000.99"),
    ("1000.99", "1,000.99$"),
    ("1000.99", "the number is not 10 which is 1,000.99€"),
    ("1000.99", "so the number is 10 which is 1,000.99m²"),
    ("0,111", "0.111"),
]


@pytest.mark.parametrize(("reference", "pred"), MATH_VERIFY_NUMBERS)
def test_math_verify_number_cases(reference: str, pred: str) -> None:
    assert grade(pred, reference, extraction="lenient").correct
    assert grade(f"#### {pred}", reference).correct
