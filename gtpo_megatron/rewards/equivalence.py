r"""math-verify extraction and the equivalence of two parsed answers.

A parsed answer is math-verify's ``parse`` result: a list holding a SymPy object (when parsing succeeded) and the
extracted string, empty when nothing was found.

Extraction (math-verify's own configs; the caller chooses what text to hand over, see ``answer_text``):

- :func:`parse_span` parses a span that IS the answer (an ``<answer>`` block, a ``####`` line, a "final answer is"
  statement, a dataset reference, a voted answer): a span without prose (``answer_text.is_bare``: ``(3, -2)``,
  ``\frac{1}{2}``, ``x = 5``, a single word) is read as one LaTeX expression and keeps its text as written; a
  span with LaTeX delimiters or prose goes through math-verify's extraction with ``\boxed{}`` first and no anchor
  required.
- :func:`parse_text` parses a whole completion: ``\boxed{}`` first (``boxed_match_priority=0``); in ``strict`` mode
  only math-verify's anchored forms (``try_extract_without_anchor=False``), in ``lenient`` mode also the last
  number / LaTeX expression.

Equivalence (:func:`equivalent`, gold first; math-verify's ``verify`` is not symmetric):

1. When both answers are single numbers without variables (percentages excepted):
   - both written as plain decimals and ``decimal_abs_tol`` is set: ``|gold - pred| <= decimal_abs_tol``. Only the
     ``paper`` reward sets it (1e-2, docs/algorithm.md section 6), for GSM8K-style decimal answers;
   - both exact rationals (integers, fractions, powers of them): exact equality, so ``\frac{1}{3^{40}}`` differs
     from ``\frac{1}{3^{41}}`` (math-verify alone calls them equal: it compares ``|a - b|`` to ``10^-15``);
   - otherwise (irrationals, decimals): relative tolerance ``|a - b| <= REL_TOL * max(|a|, |b|)`` at 30 digits.
2. Everything else (sets, tuples, intervals, matrices, equations, symbols, percentages) is math-verify's
   ``verify`` with ``numeric_precision=NESTED_PRECISION``, so values inside a tuple are compared to ``1e-50``.

Failures are loud: math-verify runs with ``raise_on_error=True`` (an internal error propagates) and without its
own ``signal.alarm`` timeouts (``parsing_timeout=None``, ``timeout_seconds=None``), because math-verify turns its
own timeouts into a silent ``False``/``[]``. The caller bounds the time instead: the reward pool wraps each answer
in :func:`gtpo_megatron.rewards.deadline.grading_deadline`, whose exception math-verify does not catch.
"""

from __future__ import annotations

import logging
import re

import sympy
from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from gtpo_megatron.rewards.answer_text import STRICT, check_extraction, is_bare

REL_TOL = 1e-6
NESTED_PRECISION = 50
_EVAL_DIGITS = 30

_LATEX = LatexExtractionConfig(boxed_match_priority=0)
_EXPR = ExprExtractionConfig()
_STRICT_CONFIGS = (
    LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False),
    ExprExtractionConfig(try_extract_without_anchor=False),
)
_LENIENT_CONFIGS = (_LATEX, _EXPR)
_PLAIN_DECIMAL_RE = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")


class _DropDisabledTimeoutWarning(logging.Filter):
    """math-verify warns once per process that its timeout is off; here the caller owns the deadline."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropDisabledTimeoutWarning())


def _parse(text: str, configs) -> list:
    return parse(text, list(configs), parsing_timeout=None, raise_on_error=True)


def parse_span(span: str) -> list:
    """Parses a span that is the answer (rules in the module docstring); ``[]`` when nothing is found."""
    if is_bare(span) and span.strip():
        values = [p for p in _parse(f"${span}$", (_LATEX,)) if isinstance(p, (sympy.Basic, sympy.MatrixBase))]
        if values:
            return [*values, span.strip()]  # the span as written (math-verify rewrites 0.5 as \frac{1}{2})
    return _parse(span, _LENIENT_CONFIGS)


def parse_text(text: str, extraction: str = STRICT) -> list:
    """Parses a whole completion in ``extraction`` mode (``strict`` or ``lenient``)."""
    configs = _STRICT_CONFIGS if check_extraction(extraction) == STRICT else _LENIENT_CONFIGS
    return _parse(text, configs)


def answer_string(parsed: list) -> str | None:
    """The extracted string of a parsed answer (``None`` when empty)."""
    strings = [p for p in parsed if isinstance(p, str)]
    if strings:
        return strings[-1].strip()
    return str(parsed[0]) if parsed else None


def _single_number(parsed: list) -> sympy.Expr | None:
    """The parsed value when it is one number without variables (percentages excepted), else ``None``."""
    value = next((p for p in parsed if isinstance(p, sympy.Basic)), None)
    if not isinstance(value, sympy.Expr) or not value.is_number or value.has(sympy.UnevaluatedExpr):
        return None
    return value


def _plain_decimal(parsed: list) -> bool:
    text = answer_string(parsed)
    return text is not None and _PLAIN_DECIMAL_RE.fullmatch(text) is not None


def _numbers_equal(gold: sympy.Expr, pred: sympy.Expr) -> bool | None:
    """Exact for two rationals, else relative at ``_EVAL_DIGITS`` digits; ``None`` when not finite numbers."""
    exact_gold, exact_pred = gold.doit(), pred.doit()
    if isinstance(exact_gold, sympy.Rational) and isinstance(exact_pred, sympy.Rational):
        return bool(exact_gold == exact_pred)
    a, b = gold.evalf(_EVAL_DIGITS), pred.evalf(_EVAL_DIGITS)
    if not (a.is_finite and b.is_finite):
        return None
    return bool(abs(a - b) <= REL_TOL * max(abs(a), abs(b)))


def equivalent(gold: list, pred: list, *, decimal_abs_tol: float | None = None) -> bool:
    """Whether parsed answer ``pred`` equals parsed answer ``gold`` (rules in the module docstring).

    Raises:
        Exception: whatever math-verify or SymPy raise on inputs they cannot compare (counted as grader errors).
    """
    if not gold or not pred:
        return False
    gold_number, pred_number = _single_number(gold), _single_number(pred)
    if gold_number is not None and pred_number is not None:
        if decimal_abs_tol is not None and _plain_decimal(gold) and _plain_decimal(pred):
            return abs(float(gold_number) - float(pred_number)) <= decimal_abs_tol
        verdict = _numbers_equal(gold_number, pred_number)
        if verdict is not None:
            return verdict
    return bool(verify(gold, pred, numeric_precision=NESTED_PRECISION, timeout_seconds=None, raise_on_error=True))
