r"""The project's answer formats: where a completion states its final answer, before any math is parsed.

Pure string functions (stdlib only). Everything MATH-style inside a span, and the whole text when no span exists,
is left to math-verify's own extraction (:mod:`gtpo_megatron.rewards.equivalence`).

- :func:`visible_text`: the text after the last ``</think>``; ``None`` when the completion was cut off inside a
  ``<think>`` block (an opened ``<think>`` with no ``</think>`` after it), which therefore has no answer.
- :func:`explicit_answer`: the span that states the answer, first found of
    1. the last ``<answer>...</answer>`` block (docs/algorithm.md section 6 prompt format);
    2. the line after the last GSM8K ``####`` marker (the number right after ``####`` is the answer, not a later
       number of a chatty tail);
    3. the last "final answer is X" statement (MATH/Minerva style, ``X`` up to ``. I hope`` or the end of its
       line), unless a ``\boxed{}`` follows it (then math-verify's boxed-first extraction decides).
  Markdown emphasis around a span (``**58**``) is removed. A span in prose that starts with a number keeps only
  that number (``#### 42 apples, 7 left`` -> ``42``); a span without prose (:func:`is_bare`) is kept whole
  (``4,56``, ``3.25,10.5``, ``x = 5``).
- :func:`reference_span`: the part of a dataset reference that holds its answer (a GSM8K solution's ``####`` line,
  else all of it; graders parse it with math-verify, boxed first). :func:`reference_answer`: the reference reduced
  to a final-answer string for the datasets' records.
- Extraction modes (:data:`EXTRACTION_MODES`): ``strict`` (MATH, AIME, AMC) accepts only an explicit answer: a span
  above, a ``\boxed{}``, or math-verify's anchored forms ("final answer ... is", "answer: X"); ``lenient``
  (GSM8K) also falls back to the last number or LaTeX expression of the text. :func:`default_extraction` gives
  each benchmark's mode.
"""

from __future__ import annotations

import re

STRICT = "strict"
LENIENT = "lenient"
EXTRACTION_MODES = (STRICT, LENIENT)
LENIENT_BENCHMARKS = frozenset({"gsm8k", "synthetic"})

_ANSWER_BLOCK_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_FINAL_ANSWER_RE = re.compile(
    r"final answer is\s*:?\s*(.+?)\s*(?:\.\s*I hope|\.?[ \t]*$)", re.IGNORECASE | re.MULTILINE
)
_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_EMPHASIS_RE = re.compile(r"^(\*\*|\*|__)(.+)\1$", re.DOTALL)
_THOUSANDS_RE = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_LEADING_NUMBER_RE = re.compile(r"-?\d[\d,./]*(?=\s)")
_DELIMITER_RE = re.compile(r"\$|\\\(|\\\[|\\boxed|\\fbox")
_TEXT_CMD_RE = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|mbox|operatorname|begin|end)\s*\{[^{}]*\}")
_WORD_RE = re.compile(r"(?<![\\a-zA-Z])[a-zA-Z]{2,}")
_SINGLE_WORD_RE = re.compile(r"[a-zA-Z]+")


def check_extraction(mode: str, *, field: str = "extraction") -> str:
    """Returns ``mode`` when it is a known extraction mode.

    Raises:
        ValueError: naming ``field``, the value and the choices.
    """
    if mode not in EXTRACTION_MODES:
        raise ValueError(
            f"{field}={mode!r} is not an extraction mode; choose one of {list(EXTRACTION_MODES)} "
            "(strict for MATH/AIME/AMC, lenient for GSM8K-style last-number answers)"
        )
    return mode


def default_extraction(benchmark: str) -> str:
    """The extraction mode a benchmark or data source is graded with: ``lenient`` for GSM8K-style sets, else strict."""
    return LENIENT if benchmark in LENIENT_BENCHMARKS else STRICT


def visible_text(completion: str) -> str | None:
    """The completion after its reasoning block, or ``None`` when it was cut off inside ``<think>``."""
    opened, closed = completion.rfind("<think>"), completion.rfind("</think>")
    if opened > closed:
        return None
    return completion[closed + len("</think>") :] if closed >= 0 else completion


def strip_emphasis(span: str) -> str:
    """``span`` without surrounding whitespace, a final full stop and Markdown emphasis (``**58**`` -> ``58``)."""
    span = span.strip()
    while True:
        bare = _EMPHASIS_RE.sub(r"\2", span).strip().removesuffix(".").strip()
        if bare == span:
            return span
        span = bare


def answer_block(text: str) -> str | None:
    """Content of the last ``<answer>...</answer>`` block, or ``None``."""
    blocks = _ANSWER_BLOCK_RE.findall(text)
    return blocks[-1] if blocks else None


def gsm8k_final(text: str) -> str | None:
    """The rest of the line after the last ``####``, or ``None`` when there is no ``####``."""
    if "####" not in text:
        return None
    return text.rsplit("####", 1)[1].lstrip(" \t").split("\n", 1)[0]


def final_answer_statement(text: str) -> str | None:
    r"""``X`` of the last "final answer is X" statement that no ``\boxed{}`` follows, or ``None``."""
    matches = list(_FINAL_ANSWER_RE.finditer(text))
    if not matches or _BOX_RE.search(text, matches[-1].start()):
        return None
    return matches[-1].group(1)


def is_bare(span: str) -> bool:
    r"""Whether ``span`` is one math expression rather than prose.

    True when it has no LaTeX delimiters and no words (commands and ``\text{}`` contents aside), or is a single word
    (``odd``, ``Even``: math-verify compares it with ``\text{odd}``).
    """
    if _DELIMITER_RE.search(span):
        return False
    return not _WORD_RE.search(_TEXT_CMD_RE.sub(" ", span)) or _SINGLE_WORD_RE.fullmatch(span.strip()) is not None


def explicit_answer(text: str) -> str | None:
    """The span that states the answer (order and rules in the module docstring); ``None`` if none."""
    for front_end in (answer_block, gsm8k_final, final_answer_statement):
        span = front_end(text)
        if span is not None:
            span = strip_emphasis(span)
            lead = None if is_bare(span) else _LEADING_NUMBER_RE.match(span)
            return lead.group(0).rstrip(".,") if lead else span
    return None


def last_boxed(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` (or ``\fbox{...}``), braces balanced; ``None`` if absent/unclosed."""
    starts = [m.end() for m in _BOX_RE.finditer(text)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for pos in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[pos], 0)
        if depth == 0:
            return text[start:pos].strip()
    return None


def _gsm8k_line(reference: str) -> str | None:
    line = (gsm8k_final(reference) or "").strip()
    return line or None


def reference_span(reference: str) -> str:
    """The part of a dataset reference that holds its answer: a GSM8K solution's ``####`` line, else all of it."""
    return _gsm8k_line(reference) or reference.strip()


def reference_answer(reference: str) -> str:
    r"""A dataset reference reduced to its final answer string, for records.

    A GSM8K ``####`` line without thousands separators (``1,234`` -> ``1234``), else the last ``\boxed{}`` of a MATH
    solution, else the reference itself.
    """
    line = _gsm8k_line(reference)
    return _THOUSANDS_RE.sub("", line) if line else last_boxed(reference) or reference.strip()
