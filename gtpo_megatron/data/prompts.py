"""Chat prompts with the paper's reasoning/answer instructions (docs/algorithm.md section 6).

The system message asks the model to think step by step inside ``<reasoning>...</reasoning>`` and to put the final
answer inside ``<answer>...</answer>``; the rewards in :mod:`gtpo_megatron.rewards` check that format. Two texts
(:data:`SYSTEM_PROMPTS`, config ``data.system_prompt``): ``authors`` (the paper recipes) and ``concise`` (the
default, the CPU demo).

- :func:`build_prompt_text` renders ``[system, user]`` with the tokenizer's chat template and the generation
  prompt (the assistant turn opener). A tokenizer without a chat template gets :data:`PLAIN_TEMPLATE`.
- :func:`choice_question`: a multiple-choice (MMLU) user message; the system prompt still asks for ``<answer>``.
- :func:`build_prompt_ids` tokenises that text. A chat template already writes any BOS it wants, so the text is
  encoded with ``add_special_tokens=False``; the plain template is encoded with the tokenizer's defaults (BOS
  added when the tokenizer adds one).

``tokenizer`` is any Hugging Face tokenizer (``transformers.PreTrainedTokenizerBase``): only ``chat_template``,
``apply_chat_template`` and ``__call__`` are used, so this module never imports transformers itself.
"""

from __future__ import annotations

from typing import Any

SYSTEM_PROMPT = (
    "You are a careful math tutor. Think through the problem step by step and write your reasoning inside "
    "<reasoning> and </reasoning>. Then write only the final answer, with no units or words, inside <answer> and "
    "</answer>. Use exactly this format:\n"
    "<reasoning>\n...\n</reasoning>\n<answer>\n...\n</answer>"
)
"""``concise``: this repository's text; it adds the format template and "answer only", which speeds up the early
format reward of small models (the CPU demo)."""
AUTHORS_SYSTEM_PROMPT = (
    "You are a helpful assistant for solving math problems. Given a question, first think step by step between "
    "<reasoning> and </reasoning>. Then, give the final answer between <answer> and </answer>."
)
"""``authors``: the paper's instruction (docs/algorithm.md section 6) and nothing more: step-by-step reasoning in a
``<reasoning>`` block, the final answer in an ``<answer>`` block, no template (the early format-reward dynamics of
the paper's comparison depend on it)."""
SYSTEM_PROMPTS = {"authors": AUTHORS_SYSTEM_PROMPT, "concise": SYSTEM_PROMPT}
"""``data.system_prompt`` choice -> system message."""
PLAIN_TEMPLATE = "{system}\n\nQuestion: {question}\n\nAnswer:\n"
CHOICE_LETTERS = "ABCDEFGHIJ"
CHOICE_INSTRUCTION = "Answer with the letter of the correct choice ({letters})."


def choice_question(question: str, choices: list[str]) -> str:
    """A multiple-choice user message: question, one ``X. text`` line per choice, the ask; ValueError if not 2..10."""
    if not 2 <= len(choices) <= len(CHOICE_LETTERS):
        raise ValueError(f"{len(choices)} choices: a multiple-choice question needs 2..{len(CHOICE_LETTERS)}")
    letters = CHOICE_LETTERS[: len(choices)]
    lines = [f"{letter}. {text}" for letter, text in zip(letters, choices, strict=True)]
    ask = CHOICE_INSTRUCTION.format(letters=", ".join(letters[:-1]) + f" or {letters[-1]}")
    return question.strip() + "\n\n" + "\n".join(lines) + "\n\n" + ask


def build_messages(question: str, *, system_prompt: str = SYSTEM_PROMPT) -> list[dict[str, str]]:
    """The ``[system, user]`` chat messages for ``question``."""
    return [{"role": "system", "content": system_prompt}, {"role": "user", "content": question}]


def _has_chat_template(tokenizer: Any) -> bool:
    """Whether the tokenizer carries a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def build_prompt_text(tokenizer: Any, question: str, *, system_prompt: str = SYSTEM_PROMPT) -> str:
    """The full prompt string (chat template + generation prompt, or the plain fallback).

    Raises:
        ValueError: if ``question`` is empty.
    """
    if not question.strip():
        raise ValueError("question is empty; every problem needs a non-empty question text")
    if not _has_chat_template(tokenizer):
        return PLAIN_TEMPLATE.format(system=system_prompt, question=question)
    text = tokenizer.apply_chat_template(
        build_messages(question, system_prompt=system_prompt), tokenize=False, add_generation_prompt=True
    )
    return str(text)


def build_prompt_ids(tokenizer: Any, question: str, *, system_prompt: str = SYSTEM_PROMPT) -> list[int]:
    """Token ids of :func:`build_prompt_text` (``list[int]``, no padding, BOS rule in the module docstring)."""
    text = build_prompt_text(tokenizer, question, system_prompt=system_prompt)
    add_special = not _has_chat_template(tokenizer)
    return list(tokenizer(text, add_special_tokens=add_special)["input_ids"])
