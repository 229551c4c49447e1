"""The partial-rollout engine on CPU: a weight update lands in the middle of generation, and versions are mixed.

The update pushes perturbed weights (the real ``reload_weights`` walk) once the requests have sampled tokens; each
completion's versions must read 0 for the tokens before the pause and 1 after, the first segment's log-probs those
of the unperturbed model (transformers, fp32, the reference).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from gtpo_megatron.builtin_models import resolve_model_path
from gtpo_megatron.plan.engines import EnginePlacement
from gtpo_megatron.rollout.engine import SamplingConfig
from gtpo_megatron.rollout.engine_guard import GuardedEngine, load_in_flight
from gtpo_megatron.rollout.engine_settings import EngineSettings
from gtpo_megatron.rollout.push import push_weights
from gtpo_megatron.rollout.vllm_async_engine import AsyncVLLMEngine
from tests.integration.test_vllm_engine import TINY_ATOL, hf_logprobs, perturb

pytestmark = [pytest.mark.integration, pytest.mark.slow]

WAIT_S = 300.0
PLACEMENT = EnginePlacement(index=0, num_engines=1, leader_rank=0, ranks=(0,), devices=())


def _wait_for_tokens(engine: AsyncVLLMEngine, at_least: int) -> None:
    """Until every running request has sampled ``at_least`` tokens (vLLM's client-side request states)."""
    states = engine._llm.llm_engine.output_processor.request_states
    deadline = time.monotonic() + WAIT_S
    while not states or min(s.detokenizer.num_output_tokens() for s in list(states.values())) < at_least:
        assert time.monotonic() < deadline, "the engine sampled no tokens"
        time.sleep(0.01)


def test_an_update_mid_generation_splits_each_completion_into_version_0_then_1():
    path = resolve_model_path("builtin:tiny-qwen2")
    original = load_file(f"{path}/model.safetensors")
    prompt, max_tokens = [1, 2, 3, 4], 400
    settings = EngineSettings(dtype="float32", max_model_len=512, max_num_seqs=4)
    with AsyncVLLMEngine(path, settings) as engine:
        result = {}
        sampling = SamplingConfig(max_tokens=max_tokens, seed=7, temperature=1.0)
        worker = threading.Thread(target=lambda: result.update(out=engine.generate([prompt], 2, sampling)))
        worker.start()
        _wait_for_tokens(engine, 3)
        guarded = GuardedEngine(engine, placement=PLACEMENT, timeout_s=WAIT_S)
        load_in_flight(guarded, 1, lambda: push_weights(engine, perturb(original).items(), bucket_bytes=2**20))
        worker.join(WAIT_S)
        completions = result["out"][0].completions
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for completion in completions:
        versions = completion.token_versions
        assert versions is not None and len(versions) == len(completion.token_ids)
        switch = versions.index(1)  # tokens before the pause carry 0, after it 1, never back
        assert switch >= 3 and set(versions[:switch]) == {0} and set(versions[switch:]) == {1}
        before = hf_logprobs(hf_model, prompt, completion.token_ids[:switch])
        assert torch.allclose(before, torch.tensor(completion.rollout_logprobs[:switch]).double(), atol=TINY_ATOL)
