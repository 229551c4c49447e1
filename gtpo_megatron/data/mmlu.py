"""MMLU (Hendrycks et al., 2021): its subjects, the source names that select them, and its rows as problems.

Sources: ``mmlu`` (every subject of the file) and ``mmlu/<subject>`` (one subject). The local file
``mmlu/<split>.jsonl`` (``gtpo-data mmlu``, from ``cais/mmlu`` config ``all``) holds one row per question:
``question`` (str), ``choices`` (2-10 str), ``answer`` (index into ``choices``, or its letter) and ``subject``.
A row becomes a :class:`Problem` whose question lists the lettered choices (``prompts.choice_question``) and whose
answer is the choice reference (``rewards.choice.choice_reference``: the letter and the choices), graded by the
letter a completion states or the text of one choice (``docs/rewards.md``); ``source`` is ``mmlu/<subject>``.
"""

from __future__ import annotations

import difflib
from typing import Any

from gtpo_megatron.data.prompts import CHOICE_LETTERS, choice_question
from gtpo_megatron.data.types import Problem
from gtpo_megatron.rewards.choice import choice_reference

MMLU = "mmlu"
SUBJECTS = (
    "abstract_algebra", "anatomy", "astronomy", "business_ethics", "clinical_knowledge", "college_biology",
    "college_chemistry", "college_computer_science", "college_mathematics", "college_medicine", "college_physics",
    "computer_security", "conceptual_physics", "econometrics", "electrical_engineering", "elementary_mathematics",
    "formal_logic", "global_facts", "high_school_biology", "high_school_chemistry", "high_school_computer_science",
    "high_school_european_history", "high_school_geography", "high_school_government_and_politics",
    "high_school_macroeconomics", "high_school_mathematics", "high_school_microeconomics", "high_school_physics",
    "high_school_psychology", "high_school_statistics", "high_school_us_history", "high_school_world_history",
    "human_aging", "human_sexuality", "international_law", "jurisprudence", "logical_fallacies", "machine_learning",
    "management", "marketing", "medical_genetics", "miscellaneous", "moral_disputes", "moral_scenarios", "nutrition",
    "philosophy", "prehistory", "professional_accounting", "professional_law", "professional_medicine",
    "professional_psychology", "public_relations", "security_studies", "sociology", "us_foreign_policy", "virology",
    "world_religions",
)  # fmt: skip
"""MMLU's 57 subjects, as ``cais/mmlu`` names them."""


def is_mmlu(source: str) -> bool:
    """Whether ``source`` names MMLU or one of its subjects."""
    return source == MMLU or source.startswith(MMLU + "/")


def subject_of(source: str) -> str | None:
    """The subject of ``mmlu/<subject>`` (``None`` for ``mmlu``: every subject).

    Raises:
        ValueError: the subject is not one of :data:`SUBJECTS`; the message lists the closest names.
    """
    subject = source.partition("/")[2] or None
    if subject is not None and subject not in SUBJECTS:
        near = difflib.get_close_matches(subject, SUBJECTS, n=3, cutoff=0.5)
        hint = f"closest: {', '.join(near)}" if near else f"the subjects are {', '.join(SUBJECTS)}"
        raise ValueError(f"{source!r}: MMLU has no subject {subject!r}; {hint} (use mmlu for all subjects)")
    return subject


def _answer_letter(value: Any, num_choices: int, where: str) -> str:
    letters = CHOICE_LETTERS[:num_choices]
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < num_choices:
        return letters[value]
    if isinstance(value, str) and value.strip().upper() in letters:
        return value.strip().upper()
    raise ValueError(
        f"{where}: answer={value!r} must be a choice index 0..{num_choices - 1} or a letter of {list(letters)}"
    )


def mmlu_problem(record: dict, *, default_id: str, where: str) -> Problem:
    """One MMLU row as a :class:`Problem` (module docstring).

    Raises:
        ValueError: a missing or ill-typed field, an unknown subject or an answer outside the choices (names
            ``where``, the field and the value).
    """
    missing = [k for k in ("question", "choices", "answer", "subject") if k not in record]
    if missing:
        raise ValueError(f"{where}: MMLU rows need question, choices, answer, subject; missing {missing}")
    question, choices, subject = record["question"], record["choices"], record["subject"]
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"{where}: question must be a non-empty string, got {question!r}")
    if not isinstance(choices, list) or not 2 <= len(choices) <= len(CHOICE_LETTERS):
        raise ValueError(f"{where}: choices must be a list of 2..{len(CHOICE_LETTERS)} strings, got {choices!r}")
    if not all(isinstance(c, str) for c in choices):
        raise ValueError(f"{where}: every choice must be a string, got {choices!r}")
    if subject not in SUBJECTS:
        raise ValueError(f"{where}: subject={subject!r} is not one of MMLU's subjects (data.mmlu.SUBJECTS)")
    letter = _answer_letter(record["answer"], len(choices), where)
    problem_id = str(record.get("id", default_id))
    answer = choice_reference(letter, choices)
    return Problem(id=problem_id, question=choice_question(question, choices), answer=answer, source=f"mmlu/{subject}")
