"""What the rollout engines return: each prompt's completions (``rollout.batch`` collates them into rows)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class Completion:
    """One sampled completion of one prompt, as the rollout engine returns it.

    ``token_ids``: response token ids (EOS included when generated; never padded).
    ``rollout_logprobs``: the engine's log-probability (nats) of each sampled token, same length as ``token_ids``.
    ``finish_reason``: ``"stop"`` (EOS or a stop string) or ``"length"`` (truncated at max tokens).
    ``routed_experts``: with routing replay, ``[n, L, K]`` int16 expert ids (0-based) of the first ``n`` tokens of
    prompt + completion in each of the L MoE layers (``n = P + R - 1``: every token fed to the model); else None.
    """

    token_ids: list[int]
    rollout_logprobs: list[float]
    text: str
    finish_reason: str
    routed_experts: torch.Tensor | None = None


@dataclass
class PromptCompletions:
    """The G completions of one prompt (``prompt_ids`` is the tokenised chat-templated prompt)."""

    prompt_ids: list[int]
    completions: list[Completion]
