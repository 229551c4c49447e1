"""Multiple-choice grading through the registered reward: the letter forms a completion may state, an option's text,
a stated letter winning over its text, two letters scoring 0, and the reference that carries letter and options."""

from __future__ import annotations

import pytest

from gtpo_megatron.rewards import get_reward
from gtpo_megatron.rewards.choice import choice_reference, read_choice_reference, stated_letter

OPTIONS = ["41", "London", "Paris", "4"]  # A..D; C is Paris


def score(completion: str, letter: str, options: list[str] = OPTIONS) -> float:
    reward = get_reward("math_verify")
    return reward(completion=completion, reference=choice_reference(letter, options), extraction="strict").score


@pytest.mark.parametrize(
    ("completion", "gold", "expected"),
    [
        ("<answer>C. 42</answer>", "C", 1.0),  # a stated letter: its text is not checked
        ("<answer>(C) Paris</answer>", "C", 1.0),
        ("<answer>C. Paris</answer>", "C", 1.0),
        ("<answer>b. 4</answer>", "B", 1.0),
        ("<answer>Option B</answer>", "B", 1.0),
        ("<answer>Answer: D</answer>", "D", 1.0),
        ("The answer is (C).", "C", 1.0),
        ("Answer: C", "C", 1.0),
        ("<answer>C</answer>", "C", 1.0),
        ("<answer>c</answer>", "C", 1.0),
        ("<answer>(B)</answer>", "B", 1.0),
        ("C", "C", 1.0),
        # siblings: other letters, cases and delimiters
        ("<answer>d) 4</answer>", "D", 1.0),
        ("<answer>[A]</answer>", "A", 1.0),
        ("<answer>A:</answer>", "A", 1.0),
        ("<answer>(a) 41</answer>", "A", 1.0),
        ("<answer>option d</answer>", "D", 1.0),
        ("<answer>Choice A</answer>", "A", 1.0),
        ("<answer>The answer is (B)</answer>", "B", 1.0),
        ("Answer: c", "C", 1.0),
        ("The answer is: (B)", "B", 1.0),
        ("<answer>The correct answer is: d</answer>", "D", 1.0),
        ("The correct answer is (b).", "B", 1.0),
        ("The correct answer is C. 6%.", "C", 1.0),
        ("Therefore the final answer is D", "D", 1.0),
        ("<reasoning>France</reasoning>\n<answer>**C.**</answer>", "C", 1.0),
        ("<answer>\\textbf{(C)}</answer>", "C", 1.0),
        ("<answer>\\text{C}</answer>", "C", 1.0),
        ("So it is $\\boxed{C}$.", "C", 1.0),
        ("Answer: A, on second thought \\boxed{C}", "C", 1.0),  # the last statement counts
        ("C. Paris", "C", 1.0),  # the chosen line copied back, no tag
        # wrong letters and no letter
        ("<answer>B. Paris</answer>", "C", 0.0),  # Paris is option C, but the stated letter wins
        ("<answer>C. 42</answer>", "B", 0.0),
        ("The answer is (C).", "D", 0.0),
        ("<answer>E</answer>", "C", 0.0),  # no option E
        ("<answer>I think C</answer>", "C", 0.0),  # prose before the letter
        ("a prime number", "A", 0.0),  # an article, not a letter
        ("<think>it is C", "C", 0.0),  # cut off while thinking
        # two different letters stated as final
        ("<answer>A or C</answer>", "C", 0.0),
        ("<answer>(A), (C)</answer>", "C", 0.0),
        ("<answer>C. Paris, or B.</answer>", "C", 0.0),
        ("C. Paris\n\nNot (A) though.", "C", 0.0),
    ],
)
def test_letter_forms(completion: str, gold: str, expected: float) -> None:
    assert score(completion, gold) == expected


VITAMINS = ["Vitamin A", "Vitamin B12", "Vitamin D", "Iron"]


@pytest.mark.parametrize(
    ("completion", "gold", "options", "expected"),
    [
        ("<answer>Paris</answer>", "C", OPTIONS, 1.0),  # an option's text, case and spacing aside
        ("<answer>  paris. </answer>", "C", OPTIONS, 1.0),
        ("The answer is Paris.", "C", OPTIONS, 1.0),
        ("<answer>London</answer>", "C", OPTIONS, 0.0),
        ("<answer>Lyon</answer>", "C", OPTIONS, 0.0),  # no option's text
        ("<answer>C. Vitamin D.</answer>", "C", VITAMINS, 1.0),  # the option's own text names no other letter
        ("<answer>vitamin d</answer>", "C", VITAMINS, 1.0),
    ],
)
def test_option_text(completion: str, gold: str, options: list[str], expected: float) -> None:
    assert score(completion, gold, options) == expected


def test_a_stated_letter_wins_and_the_extracted_answer_is_the_letter() -> None:
    reward = get_reward("math_verify")
    result = reward(
        completion="<answer>B. Paris</answer>", reference=choice_reference("C", OPTIONS), extraction="strict"
    )
    assert (result.correct, result.extracted) == (False, "B")
    two = reward(completion="<answer>A or C</answer>", reference=choice_reference("C", OPTIONS), extraction="strict")
    assert (two.correct, two.extracted) == (False, None)
    assert stated_letter("Paris") is None  # no options carried: only letters count
    assert stated_letter("two options", ("two options", "two options")) is None


def test_reference_format_and_plain_letters() -> None:
    text = choice_reference("C", OPTIONS)
    assert read_choice_reference(text).letter == "C" and read_choice_reference(text).options == tuple(OPTIONS)
    assert read_choice_reference("C") is None and read_choice_reference("{1, 2}") is None
    with pytest.raises(ValueError, match=r"letter='E' must be one of \['A', 'B', 'C', 'D'\] for 4 options"):
        choice_reference("E", OPTIONS)
    reward = get_reward("math_verify")  # a bare-letter reference keeps math-verify's reading
    assert reward(completion="\\boxed{\\text{(B)}}", reference="B", extraction="strict").correct
    assert not reward(completion="\\boxed{\\text{(B)}}", reference="C", extraction="strict").correct
