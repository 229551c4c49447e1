"""HF config features that change the math vs ``transformers``, on 2 gloo ranks.

Each tiny random model turns on one feature of ``megatron_adapter.hf_features``' table that the Megatron model must
reproduce: Llama ``attention_bias`` (q/k/v AND o_proj biases), Llama ``mlp_bias`` (tied embeddings), Llama linear
RoPE scaling, Mistral ``sliding_window`` (every layer), Qwen2 ``use_sliding_window`` with ``max_window_layers``
(only the last layer windowed), Qwen3 ``attention_bias`` with a window on every layer. Windows (3-5 tokens) are
shorter than the 16-token test input, so a dropped window shows. For each, at TP=1 (DP=2) and TP=2 (and PP=2 for
the per-layer window and the tied bias model): the vocab-parallel logits equal the HF logits (fp32, atol 1e-4,
``megatron_helpers.check_logits``) and the weight stream (export and vLLM sync source) gives back every HF tensor,
biases included, ``torch.equal`` (``check_hf_weights``). A checkpoint with a feature that cannot be built is refused
at load with a ValueError naming the field.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tests.adapter.megatron_helpers import check_hf_weights, check_logits, load_hf_model, save_random_hf_model
from tests.helpers.dist_harness import run_distributed
from tests.helpers.tiny_configs import TINY

pytestmark = pytest.mark.distributed


def _configs() -> dict:
    """``{name: (HF config, layouts)}`` of the feature models; layouts are ``(tp, pp)`` pairs."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    tp_only, with_pp = ((1, 1), (2, 1)), ((1, 1), (2, 1), (1, 2))
    return {
        "llama-attention-bias": (LlamaConfig(**TINY, attention_bias=True), tp_only),
        "llama-mlp-bias-tied": (LlamaConfig(**TINY, mlp_bias=True, tie_word_embeddings=True), with_pp),
        "llama-linear-rope": (
            LlamaConfig(**TINY, rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}),
            tp_only,
        ),
        "mistral-window-4": (MistralConfig(**TINY, sliding_window=4, head_dim=16), tp_only),
        "qwen2-window-5-last-layer": (
            Qwen2Config(**TINY, use_sliding_window=True, sliding_window=5, max_window_layers=1),
            with_pp,
        ),
        "qwen3-bias-window-3": (
            Qwen3Config(
                **TINY,
                head_dim=32,
                attention_bias=True,
                use_sliding_window=True,
                sliding_window=3,
                max_window_layers=0,
            ),
            tp_only,
        ),
    }


def _build(path: str, tp: int, pp: int):
    from gtpo_megatron.megatron_adapter.policy import MegatronPolicy
    from gtpo_megatron.parallel.groups import init_distributed
    from tests.adapter.megatron_helpers import model_section, settings_at

    groups = init_distributed(tp_size=tp, pp_size=pp)
    return MegatronPolicy.from_pretrained(settings_at(groups, model_section(path)), groups=groups)


def _check_refusal(out_root: str, rank: int) -> None:
    """A checkpoint whose RoPE Megatron cannot build fails at load, naming the field and the value."""
    from transformers import LlamaConfig

    path = f"{out_root}/llama-yarn"
    if rank == 0:
        LlamaConfig(
            **TINY,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "rope_theta": 10000.0,
                "original_max_position_embeddings": 512,
            },
        ).save_pretrained(path)
    dist.barrier()
    with pytest.raises(ValueError, match="rope_parameters.rope_type='yarn' is not supported"):
        _build(path, 1, 1)


def _worker(rank: int, world_size: int, out_root: str) -> None:
    configs = _configs()
    if rank == 0:
        for name, (config, _) in configs.items():
            save_random_hf_model(f"{out_root}/{name}", config)
    dist.barrier()
    for name, (_, layouts) in configs.items():
        path = f"{out_root}/{name}"
        hf_model = load_hf_model(path)
        for tp, pp in layouts:
            label = f"{name} tp={tp} pp={pp}"
            policy = _build(path, tp, pp)
            check_logits(policy, hf_model, label)
            check_hf_weights(policy, path, label)
    _check_refusal(out_root, rank)


def test_hf_features_match_transformers(tmp_path):
    run_distributed(_worker, 2, str(tmp_path))
