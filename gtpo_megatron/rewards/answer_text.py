r"""The project's answer formats: where a completion states its final answer (stdlib only).

:func:`markup_free`, :func:`visible_text`, :func:`explicit_answer` and :func:`reference_span` pick the text to
parse; the rules and the ``strict`` / ``lenient`` modes are in ``docs/rewards.md``.
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
# A run of * or _ that opens after a non-word character and closes before one, up to 200 characters later (linear
# time): Markdown emphasis, not a product.
_EMPHASIS_RE = re.compile(r"(?<![\w*\\)\]}])(\*{1,3}|_{1,3})(?=[^\s*_])(.{0,200}?[^\s*_\\])\1(?![\w*(\[{])")
_TEXT_DOLLAR_RE = re.compile(r"(\\\\)|\\\$")  # a LaTeX line break \\ is kept whole
_THOUSANDS_RE = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_LEADING_NUMBER_RE = re.compile(r"-?(?:[1-9]\d{0,2}(?: \d{3})+(?:\.\d+)?|\d[\d,./]*)(?=\s)")
_DELIMITER_RE = re.compile(r"(?<!\\)\$|\\\(|\\\[|\\boxed|\\fbox")
_TEXT_CMD_RE = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|mbox|operatorname|begin|end)\s*\{[^{}]*\}")
_CONNECTIVE_RE = re.compile(r"(?<![a-zA-Z\\])(?:and|or)(?![a-zA-Z])")
_WORD_RE = re.compile(r"(?<![\\a-zA-Z])[a-zA-Z]{2,}")
_SINGLE_WORD_RE = re.compile(r"[a-zA-Z]+")


def check_extraction(mode: str, *, field: str = "extraction") -> str:
    """Returns ``mode`` when it is a known extraction mode, else ``ValueError`` naming ``field`` and the choices."""
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


def markup_free(text: str) -> str:
    r"""``text`` without Markdown emphasis (``**73**`` -> ``73``) and text-mode dollar signs (``\$36`` -> ``36``)."""
    text = _TEXT_DOLLAR_RE.sub(lambda m: m.group(1) or "", text)
    while (bare := _EMPHASIS_RE.sub(r"\2", text)) != text:
        text = bare
    return text


def trim_span(span: str) -> str:
    """``span`` without surrounding whitespace and a final full stop."""
    return span.strip().removesuffix(".").strip()


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

    True without LaTeX delimiters and words (commands, ``\text{}`` contents and the list words ``and`` / ``or``
    aside), or for a single word (``odd``).
    """
    if _DELIMITER_RE.search(span):
        return False
    words = _WORD_RE.search(_CONNECTIVE_RE.sub(",", _TEXT_CMD_RE.sub(" ", span)))
    return not words or _SINGLE_WORD_RE.fullmatch(span.strip()) is not None


def explicit_answer(text: str) -> str | None:
    """The span that states the answer, or ``None``; a span in prose keeps only a leading number."""
    for front_end in (answer_block, gsm8k_final, final_answer_statement):
        span = front_end(text)
        if span is not None:
            span = trim_span(span)
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
    """The answer part of a dataset reference, :func:`markup_free`: a GSM8K solution's ``####`` line, else all of it."""
    return markup_free(_gsm8k_line(reference) or reference.strip())


def reference_answer(reference: str) -> str:
    r"""A dataset reference reduced to its final answer string, for records.

    A GSM8K ``####`` line without thousands separators (``1,234`` -> ``1234``), else the last ``\boxed{}`` of a MATH
    solution, else the reference itself.
    """
    line = _gsm8k_line(reference)
    return _THOUSANDS_RE.sub("", line) if line else last_boxed(reference) or reference.strip()
