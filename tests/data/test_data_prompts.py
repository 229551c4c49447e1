"""Chat-template prompts with the paper's instructions, and the plain fallback for template-less tokenizers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gtpo_megatron.builtin_models import cache_dir
from gtpo_megatron.data import SYSTEM_PROMPT, SYSTEM_PROMPTS, build_prompt_ids, build_prompt_text

SMOLLM2 = cache_dir() / "smollm2-135m-instruct"


class PlainTokenizer:
    """Template-less tokenizer stub: one id per character, BOS (id 0) when special tokens are requested."""

    chat_template = None

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, Any]:
        return {"input_ids": ([0] if add_special_tokens else []) + [ord(c) for c in text]}


def test_system_prompt_asks_for_the_paper_format() -> None:
    for tag in ("<reasoning>", "</reasoning>", "<answer>", "</answer>"):
        assert tag in SYSTEM_PROMPT
    assert SYSTEM_PROMPT.index("<reasoning>") < SYSTEM_PROMPT.index("<answer>")


def test_authors_system_prompt_is_the_papers_instruction_only() -> None:
    """docs/algorithm.md section 6: think step by step in <reasoning>, answer in <answer>; no template, no extras."""
    authors = SYSTEM_PROMPTS["authors"]
    assert SYSTEM_PROMPTS["concise"] == SYSTEM_PROMPT and authors != SYSTEM_PROMPT
    assert "step by step between <reasoning> and </reasoning>" in authors
    assert "final answer between <answer> and </answer>" in authors
    assert "\n" not in authors and "format" not in authors and "units" not in authors
    text = build_prompt_text(PlainTokenizer(), "What is 2 + 3?", system_prompt=authors)
    assert text.startswith(authors + "\n\nQuestion:")


def test_plain_fallback_without_chat_template() -> None:
    tokenizer = PlainTokenizer()
    text = build_prompt_text(tokenizer, "What is 2 + 3?")
    assert text == f"{SYSTEM_PROMPT}\n\nQuestion: What is 2 + 3?\n\nAnswer:\n"
    assert build_prompt_ids(tokenizer, "What is 2 + 3?") == [0] + [ord(c) for c in text]
    with pytest.raises(ValueError, match="question is empty"):
        build_prompt_text(tokenizer, "  ")


@pytest.mark.skipif(not (SMOLLM2 / "tokenizer_config.json").exists(), reason="built-in SmolLM2 not materialised")
def test_smollm2_chat_template_roundtrip() -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(Path(SMOLLM2))
    question = "Mia has 7 marbles. She finds 5 more marbles. How many marbles does Mia have now?"
    text = build_prompt_text(tokenizer, question)
    assert text == (
        f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = build_prompt_ids(tokenizer, question)
    assert tokenizer.decode(ids) == text
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids[0] == im_start and ids.count(im_start) == 3  # no extra BOS in front of the template's own
