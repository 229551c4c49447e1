r"""Constants and functions written in text mode (``\mathrm{e}``, ``\text{i}``, ``\operatorname{sin}``,
``\mathrm{d}x``) in gold and prediction: read as their plain forms before math-verify parses them."""

from __future__ import annotations

import pytest

from gtpo_megatron.rewards import get_reward
from gtpo_megatron.rewards.equivalence import upright_symbols

ONE_MINUS = "1 - \\frac{1}{\\mathrm{e}}"


def score(completion: str, reference: str) -> float:
    return get_reward("math_verify")(completion=completion, reference=reference, extraction="strict").score


@pytest.mark.parametrize(
    ("reference", "completion", "expected"),
    [
        (ONE_MINUS, "\\boxed{1}", 0.0),  # math-verify 0.9 alone reads the gold as 1
        (ONE_MINUS, "\\boxed{1 - \\frac{1}{e}}", 1.0),
        (ONE_MINUS, "\\boxed{1 - \\frac{1}{\\mathrm{e}}}", 1.0),
        (ONE_MINUS, "\\boxed{1 + \\frac{1}{\\mathrm{e}}}", 0.0),
        ("1 + \\frac{1}{\\mathrm{e}}", "\\boxed{1 - \\frac{1}{\\mathrm{e}}}", 0.0),
        ("\\frac{1}{\\mathrm{e}}", "\\boxed{\\frac{1}{e}}", 1.0),  # the gold math-verify alone cannot read
        ("\\frac{1}{\\mathrm{e}}", "\\boxed{e^{-1}}", 1.0),
        ("\\frac{1}{\\mathrm{e}}", "\\boxed{1}", 0.0),
        ("1 - \\frac{1}{e}", "\\boxed{1 - \\frac{1}{e}}", 1.0),  # the plain forms, as before
        ("1 - \\frac{1}{e}", "\\boxed{1}", 0.0),
        ("\\frac{1}{e}", "\\boxed{\\frac{1}{\\text{e}}}", 1.0),
        ("\\sqrt{\\textrm{e}}", "\\boxed{e^{1/2}}", 1.0),
        ("\\mathit{e}^{2}", "\\boxed{e^2}", 1.0),
        ("2\\cdot\\mathrm{e}", "\\boxed{2e}", 1.0),
        ("3+2\\mathrm{i}", "\\boxed{3+2i}", 1.0),
        ("3+2\\text{i}", "\\boxed{3+2i}", 1.0),
        ("3+2\\text{i}", "\\boxed{3+3i}", 0.0),
        ("\\operatorname{sin} x", "\\boxed{\\sin x}", 1.0),
        ("\\operatorname{sin} x", "\\boxed{\\cos x}", 0.0),
        ("\\mathrm{ln}(2)", "\\boxed{\\ln 2}", 1.0),
        ("\\int x \\, \\mathrm{d}x", "\\boxed{\\int x\\,dx}", 1.0),
        ("\\frac{\\mathrm{d}y}{\\mathrm{d} x}", "\\boxed{\\frac{dy}{dx}}", 1.0),
        ("5\\text{ cm}", "\\boxed{5}", 1.0),  # words stay for math-verify's unit handling
        ("5\\,\\mathrm{m}", "\\boxed{5}", 1.0),
    ],
)
def test_text_mode_constants(reference: str, completion: str, expected: float) -> None:
    assert score(completion, reference) == expected


@pytest.mark.parametrize(
    ("latex", "plain"),
    [
        ("\\frac{1}{\\mathrm{e}}", "\\frac{1}{ e}"),
        ("2\\mathrm{i}", "2i"),  # as 2i is written (math-verify reads i after a digit as a real symbol)
        ("\\cdot\\text{e}", "\\cdot e"),
        ("5\\,\\mathrm{m}", "5\\, m"),  # a unit after a space, as math-verify reads units
        ("\\mathrm{d} x", " dx"),
        ("\\operatorname{arctan}(1)", "\\arctan (1)"),
        ("\\operatorname{Re}(z)", "\\operatorname{Re}(z)"),  # no LaTeX function: kept
        ("5 \\text{cm}", "5 \\text{cm}"),
        ("\\text{ and }", "\\text{ and }"),
    ],
)
def test_rewrites(latex: str, plain: str) -> None:
    assert upright_symbols(latex) == plain
