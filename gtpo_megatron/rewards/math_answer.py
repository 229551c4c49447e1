"""Answer extraction and equivalence for GSM8K / MATH / AIME / AMC style problems.

Pure string functions (stdlib + math-verify); no torch. Used by the reward functions in
:mod:`gtpo_megatron.rewards.registry` and by the evaluator's majority vote.

Extraction order for a completion (:func:`extract_answer`):
    1. the last ``<answer>...</answer>`` block (GTPO_SPEC section 6); a ``\\boxed{}`` inside it wins;
    2. the last ``\\boxed{...}`` / ``\\fbox{...}`` in the text;
    3. the text after the last GSM8K ``####`` marker;
    4. with ``fallback_last_number=True``: the last "answer is ..." sentence (its ``$X$``, else the number after
       its last ``=``, else its first number), else the last number in the text.

Equivalence (:func:`answers_match`): if both sides read as plain numbers (commas, ``$``, ``%`` and unit words
stripped; fractions ``a/b`` and ``\\frac{a}{b}`` allowed) they match when ``|pred - ref| <= 1e-2`` (the paper's
numeric rule, section 6). Otherwise the normalised strings are compared, then math-verify compares the LaTeX
parses (sets, intervals, symbolic expressions such as ``\\sqrt{2}/2`` vs ``\\frac{\\sqrt{2}}{2}``).

math-verify guards ``parse``/``verify`` with ``signal.alarm``, which only works in a process's main thread; in any
other thread we pass ``None`` (no internal timeout) and rely on :class:`gtpo_megatron.rewards.pool.RewardPool`'s
per-answer timeout, which kills the worker process.
"""

from __future__ import annotations

import re
import threading
from fractions import Fraction

from math_verify import parse, verify

NUMERIC_TOLERANCE = 1e-2
_MV_TIMEOUT_S = 3

_ANSWER_BLOCK_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_IS_RE = re.compile(
    r"answer\s+is\s*:?\s*(?:\$([^$\n]+)\$|([^\n]*?)(?:\.\s|\.?$|\n))", re.IGNORECASE | re.MULTILINE
)
_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_THOUSANDS_RE = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_TEXT_CMD_RE = re.compile(r"\\(?:text|textbf|mathrm|mbox|textit|mathbf)\s*\{([^{}]*)\}")
_FRAC_RE = re.compile(r"^(-?)\\[dt]?frac\s*\{\s*(-?[\d.]+)\s*\}\s*\{\s*(-?[\d.]+)\s*\}$")
_PLAIN_NUMBER_RE = re.compile(r"^[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:/[-+]?\d+(?:\.\d*)?)?$")
_UNIT_SUFFIX_RE = re.compile(r"^(.*?\d)\s*((?!pi\b)[a-zA-Z]{2,}[a-zA-Z.]*)$")
_LATEX_NOISE = (
    "\\$", "\\%", "%", "^\\circ", "^{\\circ}",
    "\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "\\displaystyle", "$",
)


def _mv_timeout() -> int | None:
    """math-verify's signal timeout in the main thread, ``None`` elsewhere (signals need the main thread)."""
    return _MV_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; ``None`` if absent/unclosed."""
    starts = [m.end() for m in _BOX_RE.finditer(text)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for pos in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[pos], 0)
        if depth == 0:
            return text[start:pos].strip()
    return None


def extract_answer_block(text: str) -> str | None:
    """Stripped content of the last ``<answer>...</answer>`` block, or ``None`` when there is none."""
    blocks = _ANSWER_BLOCK_RE.findall(text)
    return blocks[-1].strip() if blocks else None


def extract_gsm8k_final(text: str) -> str | None:
    """The final answer after the last ``####`` of a GSM8K solution (commas removed), or ``None``."""
    if "####" not in text:
        return None
    return text.rsplit("####", 1)[1].strip().replace(",", "")


def extract_answer(text: str, *, fallback_last_number: bool = True) -> str | None:
    """The model's final answer in ``text`` (order in the module docstring), or ``None`` when none is found."""
    block = extract_answer_block(text)
    if block is not None:
        return extract_boxed(block) or block
    for candidate in (extract_boxed(text), extract_gsm8k_final(text)):
        if candidate is not None:
            return candidate
    if not fallback_last_number:
        return None
    phrases = _ANSWER_IS_RE.findall(text)
    latex, sentence = phrases[-1] if phrases else ("", "")
    if latex.strip():
        return latex.strip()
    # "the answer is 3 + 4 = 7 apples": the number after the last "=", else the first number of the sentence
    in_sentence = _NUMBER_RE.findall(sentence.rsplit("=", 1)[-1])
    numbers = in_sentence[:1] or _NUMBER_RE.findall(text)[-1:]
    return numbers[0].replace(",", "") if numbers else None


def reference_answer(reference: str) -> str:
    """A dataset reference reduced to its final answer (GSM8K ``####`` solution, boxed solution, or as is)."""
    return extract_gsm8k_final(reference) or extract_boxed(reference) or reference.strip()


def _strip_latex(text: str) -> str:
    """Drops ``\\boxed``, ``\\text{}``-like wrappers, sizing commands, ``$`` and surrounding punctuation."""
    inner = extract_boxed(text)
    text = inner if inner is not None else text
    for _ in range(3):
        text = _TEXT_CMD_RE.sub(r"\1", text)
    for noise in _LATEX_NOISE:
        text = text.replace(noise, "")
    return text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").strip().rstrip(".").strip()


def parse_number(text: str) -> Fraction | None:
    """``text`` as an exact rational when it is a plain number, else ``None``.

    Accepts ``1,234``, ``$1,234.00``, ``72 dollars``, ``50%``, ``-3``, ``1/2``, ``\\frac{1}{2}``, ``\\boxed{7}``.
    Rejects expressions, lists (``1,-2``), variables and anything with non-numeric LaTeX.
    """
    text = _THOUSANDS_RE.sub("", _strip_latex(text)).replace(" ", "")
    frac = _FRAC_RE.match(text)
    if frac:
        sign, num, den = frac.groups()
        text = f"{sign}{num}/{den}"
    unit = _UNIT_SUFFIX_RE.match(text)
    if unit and not _PLAIN_NUMBER_RE.match(text):
        text = unit.group(1)
    if not _PLAIN_NUMBER_RE.match(text):
        return None
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def normalize_answer(text: str | None) -> str:
    """Canonical string of an answer, used for maj@k voting (equal strings = same vote).

    Numbers become reduced fractions or integers (``"1,234"`` -> ``"1234"``; ``"\\frac{1}{2}"``, ``"0.5"`` and
    ``"1/2"`` -> ``"1/2"``). A single choice letter loses its wrappers (``"\\boxed{\\text{(B)}}"`` -> ``"B"``).
    Other LaTeX loses spacing/sizing commands and whitespace. ``None`` or empty -> ``""``.
    """
    if not text:
        return ""
    text = extract_gsm8k_final(text) or text
    number = parse_number(text)
    if number is not None:
        return str(number)
    stripped = _strip_latex(text)
    choice = re.fullmatch(r"\(?\s*([A-Ea-e])\s*\)?", stripped)
    if choice:
        return choice.group(1).upper()
    return re.sub(r"\s+", "", stripped)


def _math_verify_equal(pred: str, ref: str) -> bool:
    """math-verify equivalence of two LaTeX answers (False on a parse failure or an internal timeout)."""
    timeout = _mv_timeout()
    gold = parse(f"${_strip_latex(ref)}$", parsing_timeout=timeout)
    target = parse(f"${_strip_latex(pred)}$", parsing_timeout=timeout)
    if not gold or not target:
        return False
    return bool(verify(gold, target, timeout_seconds=timeout))


def answers_match(pred: str | None, ref: str, *, numeric_tolerance: float = NUMERIC_TOLERANCE) -> bool:
    """Whether the extracted answer ``pred`` is equivalent to the reference answer ``ref`` (rules above).

    Args:
        pred: the model's extracted answer (see :func:`extract_answer`); ``None`` never matches.
        ref: the final reference answer (see :func:`reference_answer`).
        numeric_tolerance: absolute tolerance when both are plain numbers (paper: 1e-2).
    """
    if pred is None or not pred.strip():
        return False
    pred_num, ref_num = parse_number(pred), parse_number(ref)
    if pred_num is not None and ref_num is not None:
        return abs(float(pred_num - ref_num)) <= numeric_tolerance
    if normalize_answer(pred) == normalize_answer(ref):
        return True
    return _math_verify_equal(pred, ref)
