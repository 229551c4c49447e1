r"""math-verify extraction and the equivalence of two parsed answers (rules in ``docs/rewards.md``).

A parsed answer is a list of readings (SymPy values) and the extracted string, ``[]`` when nothing was found.
math-verify runs with ``raise_on_error=True`` and without its ``signal.alarm`` timeouts (it would turn them into a
silent ``False``); the reward pool bounds the time (:mod:`gtpo_megatron.rewards.deadline`).
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
_LATEX_SPACE_RE = re.compile(r"\\[,;: ]|~")
_DIGIT_GROUPS_RE = re.compile(r"-?[1-9]\d{0,2}(?: \d{3})+(?:\.\d+)?")
_DECIMAL_COMMA_RE = re.compile(r"-?\d+,\d+")
_COMMA_GROUPS_RE = re.compile(r"-?[1-9]\d{0,2}(?:,\d{3})+")
_VALUE_TYPES = (sympy.Basic, sympy.MatrixBase)
# \mathrm{e}, \text{i}, \operatorname{sin}, ...: a text-mode command around letters; after \mathrm{d} the spaces
# before the variable go (\mathrm{d} x -> dx, the differential math-verify reads).
_UPRIGHT_RE = re.compile(r"\\(?:mathrm|textrm|text|mathit|operatorname)\{([A-Za-z]+)\}(?:(?<=\{d\})\s+(?=[A-Za-z]))?")
_FUNCTIONS = frozenset(
    "sin cos tan cot sec csc arcsin arccos arctan sinh cosh tanh log ln exp max min gcd lcm".split()
)  # math-verify reads \sin(1) but not \operatorname{sin}(1) or \mathrm{sin}(1)


class _DropDisabledTimeoutWarning(logging.Filter):
    """math-verify warns once per process that its timeout is off; here the caller owns the deadline."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropDisabledTimeoutWarning())


def upright_symbols(latex: str) -> str:
    r"""``latex`` with upright letters and function names written as math-verify reads them.

    A text-mode command (``\mathrm``, ``\text``, ``\textrm``, ``\mathit``, ``\operatorname``) around one letter
    becomes the letter, after a space unless a digit precedes it (``\frac{1}{\mathrm{e}}`` -> ``\frac{1}{ e}``,
    Euler's number; ``2\mathrm{i}`` -> ``2i``; ``5\,\mathrm{m}`` -> ``5\, m``, a unit; ``\mathrm{d} x`` -> `` dx``);
    around a function name it becomes the function's command (``\operatorname{sin}`` -> ``\sin ``). Words (units,
    prose) stay for math-verify's own text handling.
    """

    def rewrite(match: re.Match) -> str:
        name, before = match.group(1), latex[match.start() - 1 : match.start()]
        if len(name) == 1:
            return name if before.isdigit() else f" {name}"
        return f"\\{name} " if name in _FUNCTIONS else match.group(0)

    return _UPRIGHT_RE.sub(rewrite, latex)


def _parse(text: str, configs) -> list:
    parsed = parse(upright_symbols(text), list(configs), parsing_timeout=None, raise_on_error=True)
    return _number_readings(parsed)


def _number_readings(parsed: list) -> list:
    """``parsed`` with math-verify's number reading of digit groups or a decimal comma.

    ``1 000`` -> 1000 (LaTeX reads the product 1*000); ``1,22`` -> the list ``{1, 22}`` and the decimal 1.22.
    """
    text = answer_string(parsed)
    plain = _LATEX_SPACE_RE.sub(" ", text or "").strip()
    grouped = _DIGIT_GROUPS_RE.fullmatch(plain) is not None
    if not grouped and (_DECIMAL_COMMA_RE.fullmatch(plain) is None or _COMMA_GROUPS_RE.fullmatch(plain)):
        return parsed
    numbers = [p for p in parse(plain, [_EXPR], parsing_timeout=None, raise_on_error=True) if _is_value(p)]
    lists = [] if grouped else [p for p in parsed if _is_value(p)]
    return [*lists, *numbers, text]


def _is_value(item) -> bool:
    return isinstance(item, _VALUE_TYPES)


def parse_span(span: str) -> list:
    """Parses a span that is the answer; ``[]`` when nothing is found.

    A span without prose (``answer_text.is_bare``) is one LaTeX expression, its string kept as written; any other
    goes through math-verify's extraction, boxed first.
    """
    if is_bare(span) and span.strip():
        values = [p for p in _parse(f"${span}$", (_LATEX,)) if _is_value(p)]
        if values:
            return [*values, span.strip()]  # the span as written (math-verify rewrites 0.5 as 1/2)
    return _parse(span, _LENIENT_CONFIGS)


def parse_text(text: str, extraction: str = STRICT) -> list:
    """Parses a whole completion, boxed first (``strict``: anchored forms only; ``lenient``: also the last number)."""
    configs = _STRICT_CONFIGS if check_extraction(extraction) == STRICT else _LENIENT_CONFIGS
    return _parse(text, configs)


def answer_string(parsed: list) -> str | None:
    """The extracted string of a parsed answer (``None`` when empty)."""
    strings = [p for p in parsed if isinstance(p, str)]
    if strings:
        return strings[-1].strip()
    return str(parsed[0]) if parsed else None


def _finite_readings(parsed: list) -> list:
    """The readings without ``nan`` or complex infinity (math-verify cannot compare those)."""
    return [p for p in parsed if _is_value(p) and not p.has(sympy.nan, sympy.zoo)]


def _single_number(value) -> bool:
    """Whether ``value`` is one number without variables (percentages excepted)."""
    return isinstance(value, sympy.Expr) and value.is_number and not value.has(sympy.UnevaluatedExpr)


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


def _readings_equal(gold, pred, decimal_abs_tol: float | None) -> bool:
    if _single_number(gold) and _single_number(pred):
        if decimal_abs_tol is not None:
            return abs(float(gold) - float(pred)) <= decimal_abs_tol
        verdict = _numbers_equal(gold, pred)
        if verdict is not None:
            return verdict
    return bool(verify(gold, pred, numeric_precision=NESTED_PRECISION, timeout_seconds=None, raise_on_error=True))


def equivalent(gold: list, pred: list, *, decimal_abs_tol: float | None = None) -> bool:
    """Whether parsed answer ``pred`` equals parsed answer ``gold`` (gold first: math-verify is not symmetric).

    ``decimal_abs_tol`` applies when both are plain decimals (the ``paper`` reward's 1e-2).

    Raises:
        Exception: whatever math-verify or SymPy raise on inputs they cannot compare (counted as grader errors).
    """
    tol = decimal_abs_tol if decimal_abs_tol is not None and _plain_decimal(gold) and _plain_decimal(pred) else None
    pairs = [(g, p) for g in _finite_readings(gold) for p in _finite_readings(pred)]
    if any(_readings_equal(g, p, tol) for g, p in pairs):
        return True
    strings = ([p for p in gold if isinstance(p, str)], [p for p in pred if isinstance(p, str)])
    return bool(verify(*strings, timeout_seconds=None, raise_on_error=True))
