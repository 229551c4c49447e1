"""vLLM on CPU returns each completion's routed experts (``EngineSettings(routing_replay=True)``, docs/moe.md).

``builtin:tiny-qwen3-moe`` (2 layers, 8 experts, top-2), fp32, in-process engine. The reference is transformers'
fp32 router: the top-2 of ``softmax(router_logits)`` of every fed token (prompt and completion but the last token).
"""

from __future__ import annotations

import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from gtpo_megatron.builtin_models import resolve_model_path
from gtpo_megatron.rollout.engine import SamplingConfig
from gtpo_megatron.rollout.engine_settings import EngineSettings
from gtpo_megatron.rollout.vllm_engine import VLLMEngine

pytestmark = pytest.mark.integration

PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42]]


def _reference_experts(model, fed: list[int]) -> torch.Tensor:
    """``[n, L, K]`` sorted top-k experts of transformers' routers for the ``n`` fed tokens."""
    with torch.no_grad():
        router_logits = model(torch.tensor([fed]), output_router_logits=True).router_logits
    k = model.config.num_experts_per_tok
    return torch.stack([logits.reshape(len(fed), -1).topk(k).indices for logits in router_logits], 1).sort(-1).values


def test_cpu_engine_returns_routed_experts_equal_to_transformers_top_k():
    path = resolve_model_path("builtin:tiny-qwen3-moe")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config = model.config
    sampling = SamplingConfig(temperature=1.0, max_tokens=12, seed=3)
    with VLLMEngine(path, EngineSettings(dtype="float32", max_model_len=64, in_process=True, max_num_seqs=4,
                                          routing_replay=True)) as engine:  # fmt: skip
        engine.generate(PROMPTS, n=1, sampling=sampling)  # warm-up (the first generate compiles kernels)
        start = time.perf_counter()
        groups = engine.generate(PROMPTS, n=2, sampling=sampling)
        seconds = time.perf_counter() - start
        start = time.perf_counter()
        for group in groups:  # the capture's share: one more prefill per completion
            for completion in group.completions:
                engine._prefill_routed_experts(group.prompt_ids, completion.token_ids)
        capture_ms = (time.perf_counter() - start) * 1000 / (2 * len(PROMPTS))
    matched = total = 0
    for group in groups:
        for completion in group.completions:
            fed = group.prompt_ids + completion.token_ids[:-1]
            routed = completion.routed_experts
            assert routed.dtype == torch.int16
            assert routed.shape == (len(fed), config.num_hidden_layers, config.num_experts_per_tok)
            assert int(routed.min()) >= 0 and int(routed.max()) < config.num_experts
            same = (routed.long().sort(-1).values == _reference_experts(model, fed)).all(-1)
            matched, total = matched + int(same.sum()), total + same.numel()
    print(f"[vllm routed experts] {matched}/{total} token-layers equal transformers' top-k; generate {seconds:.2f} s, "
          f"capture {capture_ms:.1f} ms a completion")  # fmt: skip
    assert matched == total


def test_capture_needs_vllm_primitives(monkeypatch):
    """The engine's capture options per platform, and the refusal (before any engine starts) without vLLM's."""
    from gtpo_megatron.rollout.vllm_start import routing_kwargs

    assert routing_kwargs(False, cpu=True) == {}
    assert routing_kwargs(True, cpu=True) == {"enable_prefix_caching": False}
    gpu = routing_kwargs(True, cpu=False)
    assert gpu == {"enable_return_routed_experts": True, "environment": {"VLLM_USE_V2_MODEL_RUNNER": "1"}}
    monkeypatch.setitem(sys.modules, "vllm.model_executor.layers.fused_moe.routed_experts_capturer", None)
    with pytest.raises(RuntimeError, match=r"bind_routed_experts_capturer\), which vLLM .* lacks; install vllm>=0\.32"):
        routing_kwargs(True, cpu=True)
