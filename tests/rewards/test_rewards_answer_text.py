"""The project's answer formats (<answer>, ####, "final answer is", <think>) and the extraction modes, on literals."""

from __future__ import annotations

import pytest

from gtpo_megatron.rewards.answer_text import (
    check_extraction,
    default_extraction,
    explicit_answer,
    gsm8k_final,
    last_boxed,
    markup_free,
    reference_answer,
    reference_span,
    visible_text,
)


@pytest.mark.parametrize(
    ("text", "span"),
    [
        ("<answer>**58**</answer>", "58"),  # Markdown emphasis around the answer
        ("<answer>__58__</answer>", "58"),
        ("<answer> *58*. </answer>", "58"),
        ("<answer>\\$36</answer>", "36"),  # a text-mode dollar sign is no math delimiter
        ("#### \\$1,000 in all", "1,000"),
        ("#### 1 000 apples", "1 000"),  # digit groups: one number
        ("<answer>1331 and 1728</answer>", "1331 and 1728"),  # "and" joins a list; it is no prose
        ("#### 2 or 3", "2 or 3"),
        ("<answer>5</answer> then <answer>\\boxed{6}</answer>", "\\boxed{6}"),  # the last block
        ("9+8=17\n#### 17\n\nHope that helps with your 2 questions!", "17"),  # not the last number after ####
        ("#### 4,56", "4,56"),
        ("#### 3.25,10.5", "3.25,10.5"),
        ("first #### 1\nthen #### 2 apples\nbye 3", "2"),  # the last marker
        ("#### 42 apples, 7 left", "42"),  # prose: the number it starts with
        ("#### x = 5", "x = 5"),  # no prose: the whole span
        ("#### (3, -2)", "(3, -2)"),
        ("<answer>58 apples, 3 left over</answer>", "58"),
        ("<answer>The total is 58</answer>", "The total is 58"),  # math-verify reads it
        ("The final answer is 7 and the other is 9.", "7"),
        ("The final answer is (3, -2). I hope it is correct.", "(3, -2)"),
        ("Final Answer: The final answer is $10,455$. I hope it is correct.", "$10,455$"),
        ("So the final answer is: 7.\nCheck: 7 + 0 = 7", "7"),
        ("The final answer is 3.\nBut then \\boxed{4}", None),  # a later \boxed{} decides
        ("\\boxed{4} so the final answer is 5", "5"),
        ("Maybe 12, maybe 30.", None),
        ("\\boxed{30}", None),  # left to math-verify's boxed-first extraction
    ],
)
def test_explicit_answer(text: str, span: str | None) -> None:
    assert explicit_answer(markup_free(text)) == span  # as grade() calls it


def test_answer_block_wins_over_hashes_and_statements() -> None:
    assert explicit_answer("The final answer is 1.\n#### 2\n<answer>3</answer>") == "3"
    assert explicit_answer("The final answer is 1.\n#### 2") == "2"
    assert gsm8k_final("no marker") is None and gsm8k_final("####") == ""


@pytest.mark.parametrize(
    ("completion", "visible"),
    [
        ("<think>so 12</think>The answer is \\boxed{12}", "The answer is \\boxed{12}"),
        ("<think>so \\boxed{12}", None),  # cut off inside <think>: no answer at all
        ("<think>a</think> b <think>c", None),
        ("reasoning</think>\\boxed{3}", "\\boxed{3}"),  # chat templates that open <think> in the prompt
        ("plain \\boxed{3}", "plain \\boxed{3}"),
    ],
)
def test_visible_text(completion: str, visible: str | None) -> None:
    assert visible_text(completion) == visible


@pytest.mark.parametrize(
    ("text", "plain"),
    [
        ("Final Answer: **73**", "Final Answer: 73"),
        ("**Final Answer:** 73", "Final Answer: 73"),
        ("**Final Answer: 73**.", "Final Answer: 73."),
        ("Answer: *73*, __74__ or ***75***", "Answer: 73, 74 or 75"),
        ("<answer>**58**</answer>", "<answer>58</answer>"),
        ("**2** and **3**", "2 and 3"),
        ("We get 2*234 = 468 and 2**3 = 8", "We get 2*234 = 468 and 2**3 = 8"),  # products and powers stay
        ("(2)*3*(4) and 2 * 3 * 4", "(2)*3*(4) and 2 * 3 * 4"),
        (r"$x_1 + y_2$, $a_{n}_{k}$, \_\_", r"$x_1 + y_2$, $a_{n}_{k}$, \_\_"),  # LaTeX subscripts stay
        (r"It costs \$18.90, i.e. $\$18.90$", "It costs 18.90, i.e. $18.90$"),  # text-mode dollars go
        (r"$$a \\$$ and \\\$5", r"$$a \\$$ and \\5"),  # a line break \\ before a delimiter stays
    ],
)
def test_markup_free(text: str, plain: str) -> None:
    assert markup_free(text) == plain


def test_reference_answer_and_span() -> None:
    solution = "Natalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72"
    assert reference_answer(solution) == reference_span(solution) == "72"
    assert reference_answer("so 1,000 + 234\n#### 1,234") == "1234"  # thousands separators go, for records
    assert reference_span("so 1,000 + 234\n#### 1,234") == "1,234"  # the grader reads them itself
    boxed = "so the answer is $\\boxed{\\frac{14}{3}}$."
    assert reference_answer(boxed) == "\\frac{14}{3}"
    assert reference_span(boxed) == boxed  # graders let math-verify read the whole solution, boxed first
    assert reference_answer("  \\left( 3, \\frac{\\pi}{2} \\right) ") == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert last_boxed("\\boxed{\\frac{\\sqrt{2}}{2}} tail") == "\\frac{\\sqrt{2}}{2}"
    assert last_boxed("\\boxed{unclosed") is None


def test_extraction_modes() -> None:
    assert [default_extraction(b) for b in ("gsm8k", "synthetic", "math500", "aime24", "aime25", "amc23", "math")] == [
        "lenient",
        "lenient",
        "strict",
        "strict",
        "strict",
        "strict",
        "strict",
    ]
    assert check_extraction("strict") == "strict"
    with pytest.raises(
        ValueError,
        match=r"reward.extraction='loose' is not an extraction mode; choose one of "
        r"\['strict', 'lenient'\]",
    ):
        check_extraction("loose", field="reward.extraction")
