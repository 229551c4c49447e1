r"""Multiple-choice answers: the reference that carries the letter and the options, and the letter a completion states.

A choice reference is the JSON text ``{"letter": "C", "options": [...]}``. The span, letter forms, option texts and
the two-letter rule are in ``docs/rewards.md`` (a stated letter wins: ``B. Paris`` is B even when Paris is option C).
Stdlib only.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from gtpo_megatron.rewards.answer_text import answer_block, last_boxed, markup_free, visible_text

LETTERS = "ABCDEFGHIJ"
_LATEX_WRAP_RE = re.compile(r"\\(?:boxed|fbox|text|textbf|textrm|mathrm|mathbf)\s*\{([^{}]*)\}")
_LATEX_DELIMITER_RE = re.compile(r"\$|\\[()\[\]]")
_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_STATEMENT_RE = re.compile(r"\b(?:answer|option|choice)\s*(?:is\b\s*:?|:)", re.IGNORECASE)
_PREFIX_RE = re.compile(
    r"(?:(?:the\s+)?(?:final\s+|correct\s+|best\s+)?(?:answer|option|choice)\s*(?:is\b\s*:?|:)?\s*(?:option\s+)?)?",
    re.IGNORECASE,
)
# (C), [C], C., C), C: with optional text after; or the letter alone.
_LETTER_RE = re.compile(
    r"(?:\(([A-J])\)|\[([A-J])\]|([A-J])[.):](?!\d))(?:\s*(.*))?|([A-J])", re.IGNORECASE | re.DOTALL
)
_OTHER_LETTER_RE = re.compile(
    r"(?<![A-Za-z0-9])(?:\(([A-J])\)|([A-J])[.):](?![A-Za-z0-9])|(?:or|and|,|/)\s*([A-J])(?![A-Za-z0-9]))"
)
_SPACE_RE = re.compile(r"\s+")


@dataclass(frozen=True, slots=True)
class ChoiceReference:
    """The correct ``letter`` (``A``..``J``) and the ``options`` in letter order (``()`` when not carried)."""

    letter: str
    options: tuple[str, ...]


def choice_reference(letter: str, options: list[str] | tuple[str, ...]) -> str:
    """The reference text of a multiple-choice question; ``ValueError`` for a letter off the list."""
    if letter not in LETTERS[: len(options)]:
        raise ValueError(f"letter={letter!r} must be one of {list(LETTERS[: len(options)])} for {len(options)} options")
    return json.dumps({"letter": letter, "options": list(options)}, ensure_ascii=False)


def read_choice_reference(reference: str) -> ChoiceReference | None:
    """The :class:`ChoiceReference` a reference text encodes, or ``None`` for any other reference."""
    if not reference.lstrip().startswith("{"):
        return None
    try:
        data = json.loads(reference)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or set(data) != {"letter", "options"}:
        return None
    return ChoiceReference(letter=str(data["letter"]), options=tuple(str(o) for o in data["options"]))


def _plain(text: str) -> str:
    """``text`` without LaTeX wrappers and delimiters, spacing collapsed, a final full stop dropped."""
    while (bare := _LATEX_WRAP_RE.sub(r"\1", text)) != text:
        text = bare
    text = _SPACE_RE.sub(" ", _LATEX_DELIMITER_RE.sub("", text)).strip()
    return text.removesuffix(".").strip()


def answer_span(completion: str) -> str | None:
    """The text that states the choice (``<answer>``, last statement or box, else all); ``None``: cut off or empty."""
    text = visible_text(completion)
    if text is None:
        return None
    text = markup_free(text)
    span = answer_block(text)
    if span is None:
        statements = list(_STATEMENT_RE.finditer(text))
        boxes = list(_BOX_RE.finditer(text))
        if boxes and (not statements or boxes[-1].start() > statements[-1].start()):
            span = last_boxed(text) or ""
        elif statements:
            span = text[statements[-1].end() :].lstrip().split("\n", 1)[0]
        else:
            span = text
    span = _plain(span)
    return span or None


def stated_letter(span: str, options: tuple[str, ...] = ()) -> str | None:
    """The letter ``span`` states among ``len(options)`` choices (A..J when ``()``); ``None``: none or two."""
    letters = LETTERS[: len(options)] if options else LETTERS
    body = span[_PREFIX_RE.match(span).end() :]
    match = _LETTER_RE.fullmatch(body)
    letter = (match.group(1) or match.group(2) or match.group(3) or match.group(5)).upper() if match else None
    if letter is None or letter not in letters:
        texts = [_plain(o).casefold() for o in options]
        return letters[texts.index(span.casefold())] if texts.count(span.casefold()) == 1 else None
    rest = match.group(4) or ""
    if options and _plain(rest).casefold() == _plain(options[LETTERS.index(letter)]).casefold():
        return letter
    others = {next(g for g in m.groups() if g).upper() for m in _OTHER_LETTER_RE.finditer(rest)}
    return None if others & (set(letters) - {letter}) else letter


def grade_choice(completion: str, reference: ChoiceReference) -> tuple[bool, str | None]:
    """``(correct, extracted letter)`` of ``completion`` against a choice reference (``None``: no single letter)."""
    span = answer_span(completion)
    letter = stated_letter(span, reference.options) if span is not None else None
    return letter == reference.letter, letter
