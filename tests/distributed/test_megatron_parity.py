"""Megatron GPTModel built from HF checkpoints vs ``transformers``, on 2 gloo ranks.

One spawn walks through the layouts TP=1 (DP=2), TP=2 and PP=2 and checks, for tiny-qwen2 (qkv bias, untied,
padded vocabulary), tiny-llama (tied embeddings), a random tiny Qwen3 (q/k norms, head_dim != hidden/heads) and
the real SmolLM2-135M-Instruct (TP=1 and PP=2 only: its 9 attention heads / 3 KV groups cannot be split over 2
TP ranks, which must raise ValueError unless ``pad_attention_heads``, see ``test_head_padding.py``; TP=3 is the
``slow`` test):
* the last stage's vocab-parallel logits ``[B, S, V/tp]`` equal the HF logits of the same columns (float32,
  atol 1e-4) and padded vocabulary columns are exactly 0;
* ``iter_hf_weights`` yields, on every rank, exactly the original HF tensor names with ``torch.equal`` values;
* ``export_hf`` writes a folder whose safetensors equal the original and which ``transformers`` loads.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.adapter.megatron_helpers import (
    SMOLLM2,
    TINY_LLAMA,
    TINY_QWEN2,
    check_hf_weights,
    check_logits,
    load_hf_model,
    model_section,
    save_random_hf_model,
    settings_at,
)
from tests.helpers.dist_harness import run_distributed
from tests.helpers.tiny_configs import tiny_qwen3

pytestmark = pytest.mark.distributed

PAD_MULTIPLE = 1000  # vocab 49152 -> padded 50000 at TP=1 and TP=2: exercises padded rows on the last TP rank


def _check_export(policy, path: str, out_dir: str, label: str) -> None:
    from safetensors.torch import load_file

    from gtpo_megatron.builtin_models import resolve_model_path

    policy.export_hf(out_dir)
    if policy.groups.rank == 0:
        exported = load_file(f"{out_dir}/model.safetensors")
        original = load_file(f"{resolve_model_path(path)}/model.safetensors")
        assert exported.keys() == original.keys()
        assert all(torch.equal(exported[k], original[k]) for k in original), f"{label}: export differs"
        ids = torch.randint(0, 1000, (1, 8))
        with torch.no_grad():
            same = torch.equal(load_hf_model(out_dir)(ids).logits, load_hf_model(path)(ids).logits)
        assert same, f"{label}: transformers gives other logits for the exported folder"
    dist.barrier()


def _build(path: str, tp: int, pp: int, **model_fields):
    from gtpo_megatron.megatron_adapter.policy import MegatronPolicy
    from gtpo_megatron.parallel.groups import init_distributed

    groups = init_distributed(tp_size=tp, pp_size=pp)
    return MegatronPolicy.from_pretrained(settings_at(groups, model_section(path, **model_fields)), groups=groups)


def _save_tiny_qwen3(out_dir: str) -> None:
    """Random 2-layer Qwen3 (q/k norms, head_dim 32 != hidden/heads, tied embeddings, perturbed norm weights)."""
    save_random_hf_model(out_dir, tiny_qwen3())


def _worker(rank: int, world_size: int, out_root: str) -> None:
    qwen3 = f"{out_root}/tiny-qwen3"
    if rank == 0:
        _save_tiny_qwen3(qwen3)
    dist.barrier()
    models = {name: load_hf_model(name) for name in (TINY_QWEN2, TINY_LLAMA, qwen3)}
    for tp, pp in ((1, 1), (2, 1), (1, 2)):
        for name, hf_model in models.items():
            label = f"{name} tp={tp} pp={pp}"
            policy = _build(name, tp, pp, make_vocab_size_divisible_by=PAD_MULTIPLE)
            check_logits(policy, hf_model, label)
            check_hf_weights(policy, name, label)
            if (tp, pp) != (1, 1) and name != qwen3:
                _check_export(policy, name, f"{out_root}/{name.split(':')[1]}-tp{tp}-pp{pp}", label)
    smollm2 = load_hf_model(SMOLLM2)
    for tp, pp in ((1, 1), (1, 2)):
        check_logits(_build(SMOLLM2, tp, pp), smollm2, f"{SMOLLM2} tp={tp} pp={pp}")
    with pytest.raises(ValueError, match="num_attention_heads=9 .*model.pad_attention_heads=true"):
        _build(SMOLLM2, 2, 1)


def test_megatron_matches_transformers_and_round_trips(tmp_path):
    run_distributed(_worker, 2, str(tmp_path))


def _smollm2_tp3_worker(rank: int, world_size: int) -> None:
    check_logits(_build(SMOLLM2, 3, 1), load_hf_model(SMOLLM2), f"{SMOLLM2} tp=3 pp=1")


@pytest.mark.slow
def test_smollm2_tensor_parallel_three_ranks():
    """SmolLM2's 9 heads / 3 KV groups split over TP=3 (the smallest TP > 1 it allows); 3 processes."""
    run_distributed(_smollm2_tp3_worker, 3)
