"""Tiny hand-written rollouts shared by the batch, algorithm and sampling tests."""

from __future__ import annotations

from gtpo_megatron.batch import TrainBatch
from gtpo_megatron.config import PRESETS, AlgorithmConfig
from gtpo_megatron.rollout.batch import collate_completions
from gtpo_megatron.rollout.types import Completion, PromptCompletions

EOS = 2


def make_group(prompt: list[int], responses: list[list[int]], finish: list[str] | None = None) -> PromptCompletions:
    """One prompt's completions with rollout log-probs -0.5 per token (finish reason ``stop`` unless given)."""
    finish = finish or ["stop"] * len(responses)
    return PromptCompletions(
        prompt_ids=prompt,
        completions=[
            Completion(token_ids=r, rollout_logprobs=[-0.5] * len(r), text="", finish_reason=f)
            for r, f in zip(responses, finish)
        ],
    )


def conflict_batch() -> TrainBatch:
    """One prompt, G=4: completions 0,1 correct (A>0), 2,3 wrong (A<0). All start with token 11; 0 and 2 also end
    with "12 EOS"; 3 ends with EOS only."""
    responses = [[11, 20, 12, EOS], [11, 21, EOS], [11, 30, 12, EOS], [11, 31, 32, EOS]]
    return collate_completions([make_group([1, 1], responses)], pad_token_id=EOS)


def algorithm_section(name: str = "gtpo", **fields) -> AlgorithmConfig:
    """The ``name`` preset with group size 4 (no overlong buffer unless given), plus ``fields``."""
    preset = {k: v for k, v in PRESETS[name].items() if k != "overlong_buffer_len"}
    return AlgorithmConfig(name=name, **{**preset, "group_size": 4, **fields})
