"""Reward registry contract and the paper's 0 / 1 / 1.5 / 10 / 20 scheme on literal completions."""

from __future__ import annotations

import math
import threading

import pytest

from gtpo_megatron.rewards import (
    REWARD_REGISTRY,
    RewardResult,
    decimal_tolerance,
    get_reward,
    grading_deadline,
    register_reward,
)

GOOD = "<reasoning>\n7 + 5 = 12\n</reasoning>\n<answer>\n12\n</answer>\n"


@pytest.mark.parametrize(
    ("completion", "score", "correct", "format_ok"),
    [
        ("I do not know.", 0.0, False, False),
        ("just 12", 0.0, True, False),  # right number, no format: the paper gives nothing
        ("<reasoning>7 + 5 = 12</reasoning> so 12", 1.0, True, False),
        ("<reasoning>7 + 5 = 12</reasoning> <answer>12", 1.5, True, False),
        ("<answer>12</answer>", 1.0, True, False),
        ("<reasoning> 7 + 5 <answer>12</answer>", 1.5, True, False),
        ("<reasoning>x</reasoning><answer>12</answer> and more text", 1.5, True, False),  # answer block not last
        ("<reasoning>7 + 5 = 13</reasoning>\n<answer>13</answer>", 10.0, False, True),
        (GOOD, 20.0, True, True),
        ("<reasoning>half</reasoning><answer>\\boxed{0.5}</answer>", 10.0, False, True),  # reference is 12
    ],
)
def test_paper_reward_cases(completion: str, score: float, correct: bool, format_ok: bool) -> None:
    result = get_reward("paper")(completion=completion, reference="12", extraction="lenient")
    assert (result.score, result.correct, result.format_ok) == (score, correct, format_ok)
    strict = get_reward("paper")(completion=completion, reference="12", extraction="strict")
    assert strict.score == score  # the paper's points need the <answer> block, which both modes read


def test_paper_reward_reduces_gsm8k_solutions_and_latex() -> None:
    solution = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72"
    assert get_reward("paper")(completion=GOOD.replace("12", "72"), reference=solution, extraction="strict").score == 20
    latex = "<reasoning>r</reasoning><answer>\\sqrt{2}/2</answer>"
    assert get_reward("paper")(completion=latex, reference="\\frac{\\sqrt{2}}{2}", extraction="strict").score == 20


def test_only_the_paper_reward_has_the_decimal_tolerance() -> None:
    """docs/algorithm.md section 6: the paper's "numeric within 1e-2", for plain decimal answers only."""
    close = "<reasoning>r</reasoning><answer>0.509</answer>"
    assert (decimal_tolerance("paper"), decimal_tolerance("math_verify"), decimal_tolerance("format")) == (
        1e-2,
        None,
        None,
    )
    assert get_reward("paper")(completion=close, reference="0.5", extraction="strict").score == 20.0
    assert get_reward("math_verify")(completion=close, reference="0.5", extraction="strict").score == 0.0
    far = "<reasoning>r</reasoning><answer>\\frac{1}{3^{41}}</answer>"
    assert get_reward("paper")(completion=far, reference="\\frac{1}{3^{40}}", extraction="strict").score == 10.0


def test_math_verify_and_format_rewards_are_binary() -> None:
    math_verify, fmt = get_reward("math_verify"), get_reward("format")
    assert math_verify(completion="The answer is \\boxed{12}", reference="12", extraction="strict") == RewardResult(
        1.0, True, False, "12"
    )
    assert math_verify(completion="The answer is 12", reference="12", extraction="lenient").score == 1.0
    assert math_verify(completion="so 12", reference="12", extraction="strict").score == 0.0
    assert math_verify(completion=GOOD, reference="13", extraction="strict").score == 0.0
    assert fmt(completion=GOOD, reference="13", extraction="strict") == RewardResult(1.0, False, True, "12")
    assert fmt(completion="12", reference="12", extraction="lenient").score == 0.0


@pytest.mark.parametrize("name", sorted(REWARD_REGISTRY))
def test_every_registered_reward_follows_the_contract(name: str) -> None:
    for completion in (GOOD, "", "<answer>\\frac{1}{0}</answer>", "\\boxed{", "<think>\\boxed{12}"):
        result = get_reward(name)(completion=completion, reference="12", extraction="strict")
        assert isinstance(result, RewardResult)
        assert math.isfinite(result.score)
        assert result.extracted is None or isinstance(result.extracted, str)


def test_registry_rejects_duplicates_and_unknown_names() -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_reward("paper")(lambda *, completion, reference, extraction: RewardResult(0.0, False, False, None))
    with pytest.raises(ValueError, match="available rewards: \\['format', 'math_verify', 'paper'"):
        get_reward("nope")


def test_latex_equivalence_works_outside_the_main_thread() -> None:
    """Signals only work in the main thread: rewards never use math-verify's own, and the deadline is a no-op."""
    out: list[RewardResult] = []
    completion = "<reasoning>r</reasoning><answer>\\frac{\\sqrt{2}}{2}</answer>"
    reward = get_reward("paper")

    def run() -> None:
        with grading_deadline(0.5):
            out.append(reward(completion=completion, reference="\\sqrt{2}/2", extraction="strict"))

    worker = threading.Thread(target=run)
    worker.start()
    worker.join(timeout=30)
    assert out and out[0].correct and out[0].score == 20.0
