"""Grading a completion against its reference, and maj@k answer equality (steps in ``docs/rewards.md``)."""

from __future__ import annotations

from dataclasses import dataclass

from gtpo_megatron.rewards.answer_text import STRICT, explicit_answer, markup_free, reference_span, visible_text
from gtpo_megatron.rewards.choice import grade_choice, read_choice_reference
from gtpo_megatron.rewards.equivalence import answer_string, equivalent, parse_span, parse_text


@dataclass(frozen=True, slots=True)
class Verdict:
    """Grading outcome: ``correct``, and ``extracted``, the answer as text (``None``: the completion states none)."""

    correct: bool
    extracted: str | None


def extract(completion: str, extraction: str = STRICT) -> list:
    """The parsed answer of ``completion`` (math-verify's list: SymPy value and string; ``[]`` when none)."""
    text = visible_text(completion)
    if text is None:
        return []
    text = markup_free(text)
    span = explicit_answer(text)
    return parse_span(span) if span is not None else parse_text(text, extraction)


def grade(
    completion: str, reference: str, *, extraction: str = STRICT, decimal_abs_tol: float | None = None
) -> Verdict:
    """Grades ``completion`` against ``reference`` (``decimal_abs_tol``: for two plain decimals, the paper's 1e-2).

    A multiple-choice reference (``choice.choice_reference``) is graded by the stated letter (:mod:`.choice`).

    Raises:
        ValueError: unknown ``extraction`` or an unreadable reference; math-verify / SymPy errors propagate.
    """
    choices = read_choice_reference(reference)
    if choices is not None:
        return Verdict(*grade_choice(completion, choices))
    pred = extract(completion, extraction)
    if not pred:
        return Verdict(correct=False, extracted=None)
    gold = parse_span(reference_span(reference))
    if not gold:
        raise ValueError(f"reference {reference[:80]!r} holds no answer math-verify can read; fix the dataset record")
    return Verdict(equivalent(gold, pred, decimal_abs_tol=decimal_abs_tol), answer_string(pred))


def same_answer(first: str, second: str, *, decimal_abs_tol: float | None = None) -> bool:
    """Whether two extracted answers are the same answer (either direction of the reward's equivalence)."""
    if first == second:
        return True
    a, b = parse_span(first), parse_span(second)
    return equivalent(a, b, decimal_abs_tol=decimal_abs_tol) or equivalent(b, a, decimal_abs_tol=decimal_abs_tol)
