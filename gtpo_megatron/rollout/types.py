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
    ``token_versions``: with partial rollouts, the policy version (completed training steps) of the weights that
    sampled each token, same length as ``token_ids``; else None (the whole completion has one version).
    """

    token_ids: list[int]
    rollout_logprobs: list[float]
    text: str
    finish_reason: str
    routed_experts: torch.Tensor | None = None
    token_versions: list[int] | None = None


@dataclass
class PromptCompletions:
    """The G completions of one prompt (``prompt_ids`` is the tokenised chat-templated prompt)."""

    prompt_ids: list[int]
    completions: list[Completion]


def span_versions(spans: list | None, num_tokens: int) -> list[int] | None:
    """Each token's policy version from vLLM's ``CompletionOutput.weight_versions`` (``version, start, end`` spans).

    None when the spans do not cover ``num_tokens`` with integer labels (an engine that never labels its weights
    reports ``"default"``); ``rollout/vllm_async_engine.py`` labels them with the completed training steps.
    """
    if not spans or any(not str(span.version).isdigit() for span in spans):
        return None
    versions = [int(span.version) for span in spans for _ in range(span.start, span.end)]
    return versions if len(versions) == num_tokens else None
