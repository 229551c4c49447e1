"""vLLM (CPU, in-process) serving a PEFT adapter folder against the same engine fed the merged weights.

Random rank-8 adapters (alpha 16) on all seven projections of tiny-qwen2, written by ``write_adapter_folder``: an
engine started with LoRA (``EngineSettings.max_lora_rank``) and given the folder (``load_adapter``) decodes the
same near-greedy tokens as an engine without LoRA given ``W + alpha / rank * B @ A`` (``push_weights``), with
log-probs within ``TINY_ATOL`` (fp32), and other tokens or log-probs than the base model (the adapter is applied).
A second version replaces the first under a new LoRA id; loading the first folder again restores its outputs.
"""

from __future__ import annotations

import pytest
import torch

from gtpo_megatron.builtin_models import resolve_model_path
from gtpo_megatron.rollout.engine import SamplingConfig
from gtpo_megatron.rollout.engine_settings import EngineSettings
from gtpo_megatron.rollout.peft_adapter import AdapterSpec, tensor_key, write_adapter_folder
from gtpo_megatron.rollout.push import push_weights
from gtpo_megatron.rollout.vllm_engine import VLLMEngine
from tests.adapter.megatron_helpers import TINY_QWEN2, load_hf_model
from tests.helpers.lora_reference import merged_hf_weights, random_adapters

pytestmark = pytest.mark.integration

TINY_ATOL = 1e-4  # fp32 on both sides, as tests/integration/test_vllm_engine.py
RANK, ALPHA = 8, 16.0
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = [[1, 2, 3, 4], [17, 5, 99, 3, 12, 8]]
GREEDY = SamplingConfig(temperature=0.01, max_tokens=16, seed=0)
SETTINGS = {"dtype": "float32", "max_model_len": 64, "in_process": True, "max_num_seqs": 4}


def _adapters(tmp_path, seed: int):
    """``(folder, merged HF weights)`` of one random adapter set."""
    hf_model = load_hf_model(TINY_QWEN2)
    adapters = random_adapters(hf_model, ALL, RANK, seed=seed)
    tensors = {tensor_key(layer, proj, which): t.detach().float()
               for (layer, proj), pair in adapters.items() for which, t in zip("AB", pair)}  # fmt: skip
    spec = AdapterSpec(rank=RANK, alpha=ALPHA, projections=ALL)
    folder = write_adapter_folder(tmp_path / f"adapter-{seed}", tensors, spec)
    merged = {name: t.float() for name, t in merged_hf_weights(hf_model, adapters, ALPHA / RANK).items()}
    return str(folder), merged


def _run(engine):
    """``(tokens, scores of those tokens)`` of the near-greedy completions of ``PROMPTS``."""
    tokens = [out.completions[0].token_ids for out in engine.generate(PROMPTS, 1, GREEDY)]
    return tokens, engine.score(PROMPTS, tokens)


def _max_diff(a, b) -> float:
    return max(float((torch.tensor(x) - torch.tensor(y)).abs().max()) for x, y in zip(a, b))


def test_adapter_matches_merged_weights(tmp_path):
    path = resolve_model_path(TINY_QWEN2)
    first, merged_first = _adapters(tmp_path, seed=1)
    second, _ = _adapters(tmp_path, seed=2)
    with VLLMEngine(path, EngineSettings(**SETTINGS, max_lora_rank=RANK)) as engine:
        base_tokens, base_scores = _run(engine)
        assert engine.load_adapter(first) == 1
        adapter_tokens, adapter_scores = _run(engine)
        assert engine.load_adapter(second) == 2
        second_tokens, _ = _run(engine)
        assert engine.load_adapter(first) == 3
        again_tokens, again_scores = _run(engine)
    with VLLMEngine(path, EngineSettings(**SETTINGS)) as engine:
        push_weights(engine, merged_first.items())
        merged_tokens, merged_scores = _run(engine)
    print(f"adapter {adapter_tokens} merged {merged_tokens} base {base_tokens}; max |dlogp| adapter-merged "
          f"{_max_diff(adapter_scores, merged_scores):.2e}")  # fmt: skip
    assert adapter_tokens == merged_tokens
    assert _max_diff(adapter_scores, merged_scores) < TINY_ATOL
    assert base_tokens != adapter_tokens or _max_diff(base_scores, adapter_scores) > 1e-2
    assert second_tokens != adapter_tokens and again_tokens == adapter_tokens
    assert _max_diff(again_scores, adapter_scores) < TINY_ATOL
