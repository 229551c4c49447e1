"""SamplingConfig / prompt validation and request seeding; no engine is started."""

from __future__ import annotations

import pytest

from gtpo_megatron.rollout.engine import RolloutEngine, SamplingConfig, validate_prompt_ids
from gtpo_megatron.rollout.vllm_engine import VLLMEngine, request_seed


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": 0.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": "</answer>"}, "stop"),
    ],
)
def test_sampling_config_rejects(kwargs, field):
    with pytest.raises(ValueError, match=f"sampling.{field}"):
        SamplingConfig(**kwargs)


def test_validate_prompt_ids():
    validate_prompt_ids([[1, 2, 3]], max_model_len=8, max_tokens=5)
    with pytest.raises(ValueError, match="empty"):
        validate_prompt_ids([], max_model_len=8, max_tokens=1)
    with pytest.raises(ValueError, match=r"prompt_ids\[1\] is empty"):
        validate_prompt_ids([[1], []], max_model_len=8, max_tokens=1)
    with pytest.raises(ValueError, match=r"prompt_ids\[0\] has 4 tokens and max_tokens=5.*max_model_len=8"):
        validate_prompt_ids([[1, 2, 3, 4]], max_model_len=8, max_tokens=5)


def test_request_seeds_are_distinct_and_stable():
    seeds = {request_seed(s, i) for s in range(50) for i in range(64)}
    assert len(seeds) == 50 * 64
    assert request_seed(3, 7) == request_seed(3, 7)
    assert all(0 <= s < 2**31 for s in seeds)


def test_vllm_engine_satisfies_protocol_structurally():
    for name in ("generate", "update_weights", "begin_weight_update", "load_weight_bucket",
                 "finish_weight_update", "sleep", "wake_up", "close"):
        assert callable(getattr(VLLMEngine, name)), name
    assert {"generate", "update_weights", "sleep", "wake_up", "close"} <= set(dir(RolloutEngine))
