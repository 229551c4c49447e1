"""Exact attention-head padding (``megatron_adapter.head_padding``) on 2 gloo ranks.

* SmolLM2-135M-Instruct (9 heads, 3 KV groups) at TP=2 with ``pad_attention_heads=True`` (4 groups, 12 heads): the
  vocab-parallel logits equal ``transformers``' (fp32, atol 1e-4) and ``iter_hf_weights`` yields every original HF
  tensor, ``torch.equal``, under its original name.
* A random tiny Llama with 3 KV groups x 2 heads (head_dim 32, hidden 96, tied embeddings): two AdamW steps at
  TP=2 with padding vs the same two steps at TP=1 (DP=2) without. At each step the gradient of every real weight
  equals the TP=1 gradient (atol 1e-5) and so does the global gradient norm; padded weights and their gradients
  are exactly 0 after every step; the exported HF folder has the original config and equals the TP=1 weights.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from gtpo_megatron.ops import LossSpec
from tests.adapter.megatron_helpers import (
    SMOLLM2,
    TINY_LLAMA,
    DictReader,
    check_hf_weights,
    check_logits,
    load_hf_model,
    make_batch,
    megatron_named_params,
    model_section,
    save_random_hf_model,
    settings_at,
)
from tests.helpers.dist_harness import run_distributed
from tests.helpers.tiny_configs import tiny_llama

pytestmark = pytest.mark.distributed

ROWS = 4
GRAD_ATOL = 1e-5  # fp32 gradients accumulated in different orders (TP splits, DP sums, padded matmul widths)
WEIGHT_ATOL = 1e-5  # two Adam steps from those gradients; adam_eps=1e-4 keeps lr/eps sensitivity small
LOSS = LossSpec(loss_name="gtpo", aggregation="token-mean", clip_eps_low=0.2, clip_eps_high=0.2)
OPTIM = dict(lr=1e-3, weight_decay=0.1, adam_eps=1e-4)


def _build(path: str, tp: int, *, optim: dict | None = None, **model_fields):
    from gtpo_megatron.config import OptimConfig
    from gtpo_megatron.megatron_adapter.policy import MegatronPolicy
    from gtpo_megatron.parallel.groups import init_distributed

    groups = init_distributed(tp_size=tp, pp_size=1)
    optim = dict(optim or {})
    adam_eps = optim.pop("adam_eps", 1e-8)  # no config field: a PolicySettings one
    settings = settings_at(groups, model_section(path, **model_fields), optim=OptimConfig(**optim, clip_grad=1.0),
                           adam_eps=adam_eps)  # fmt: skip
    return MegatronPolicy.from_pretrained(settings, groups=groups)


def _save_three_group_llama(out_dir: str) -> None:
    """Random 2-layer Llama, 3 KV groups x 2 heads, head_dim 32 (attention width 192 != hidden 96), tied
    embeddings, perturbed norms; the tokenizer of ``builtin:tiny-llama`` so the folder is complete."""

    from gtpo_megatron.builtin_models import resolve_model_path

    config = tiny_llama(
        vocab_size=49152,
        hidden_size=96,
        intermediate_size=128,
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=32,
        tie_word_embeddings=True,
    )
    save_random_hf_model(out_dir, config, tokenizer_from=resolve_model_path(TINY_LLAMA))


def _padded_part(name: str, tensor: torch.Tensor, geometry, tp_rank: int) -> torch.Tensor | None:
    """The entries of this rank's shard that belong to padded heads (written from the layout definition: QKV rows
    grouped per KV group, ``linear_proj`` columns per query head, padded groups after the HF ones), else None."""
    d, per_group = geometry.head_dim, geometry.num_heads // geometry.num_query_groups
    if name.endswith("linear_qkv.weight") or name.endswith("linear_qkv.bias"):
        local = geometry.padded_num_query_groups // geometry.tp_size
        groups = tensor.reshape(local, (per_group + 2) * d, *tensor.shape[1:])
        return groups[[g for g in range(local) if tp_rank * local + g >= geometry.num_query_groups]]
    if name.endswith("linear_proj.weight"):
        local = geometry.padded_num_heads // geometry.tp_size
        heads = tensor.reshape(tensor.shape[0], local, d)
        return heads[:, [h for h in range(local) if tp_rank * local + h >= geometry.num_heads]]
    return None


def _hf_grads(policy) -> dict[str, torch.Tensor]:
    """Full gradients of a TP=1 policy under HF names (``main_grad`` is already reduced over DP)."""
    from gtpo_megatron.megatron_adapter import hf_conversion

    grads = {}
    for name, param in megatron_named_params(policy):
        mapping = hf_conversion.param_mapping(name, policy.geometry)
        grads.update(hf_conversion.hf_from_shards(mapping, [param.main_grad.clone()], policy.geometry))
    return grads


def _two_steps(policy, batch, on_grads) -> list[float]:
    """Two optimizer steps on this DP rank's rows of ``batch``; ``on_grads(step)`` runs before each update."""
    from gtpo_megatron.megatron_adapter.optimizer import optimizer_step

    share = ROWS // policy.groups.dp_size
    local = batch.select(slice(policy.groups.dp_rank * share, (policy.groups.dp_rank + 1) * share))
    norms = []
    for step in range(2):
        policy.forward_backward(local, LOSS)
        on_grads(step)
        result = optimizer_step(policy.optimizer, policy.scheduler, policy.ddp_model)
        assert result["skipped"] == 0.0
        norms.append(result["grad_norm"])
    return norms


def _check_padded_step(policy, ref_grads: dict[str, torch.Tensor], step: int) -> float:
    """Real gradients equal the TP=1 ones (padded entries expected 0); padded weights and grads are exactly 0."""
    from gtpo_megatron.megatron_adapter import hf_conversion, hf_loading

    geometry, tp_rank, worst = policy.geometry, policy.groups.tp_rank, 0.0
    for name, param in megatron_named_params(policy):
        mapping = hf_conversion.param_mapping(name, geometry)
        expected = hf_loading.shard_from_hf(mapping, DictReader(ref_grads), geometry, tp_rank)
        diff = (param.main_grad - expected).abs().max().item()
        worst = max(worst, diff)
        assert diff <= GRAD_ATOL, f"step {step}: grad of {name} differs from TP=1 by {diff}"
        for label, tensor in (("weight", param.detach()), ("grad", param.main_grad)):
            padded = _padded_part(name, tensor, geometry, tp_rank)
            assert padded is None or bool((padded == 0).all()), f"step {step}: padded {label} of {name} != 0"
    return worst


def _tiny_worker(rank: int, world_size: int, out_root: str) -> None:
    path = f"{out_root}/three-groups"
    if rank == 0:
        _save_three_group_llama(path)
    dist.barrier()
    batch = make_batch(rows=ROWS, seed=5)
    reference = _build(path, 1, optim=OPTIM)  # DP = 2, no padding needed
    ref_grads = []
    ref_norms = _two_steps(reference, batch, lambda step: ref_grads.append(_hf_grads(reference)))
    ref_weights = dict(reference.iter_hf_weights())
    reference = None  # free the TP=1 model before the padded one is built
    policy = _build(path, 2, pad_attention_heads=True, optim=OPTIM)
    assert (policy.geometry.padded_num_query_groups, policy.geometry.num_pad_groups) == (4, 1)
    worst = []
    norms = _two_steps(policy, batch, lambda step: worst.append(_check_padded_step(policy, ref_grads[step], step)))
    assert all(abs(a - b) <= 1e-5 * b for a, b in zip(norms, ref_norms)), (norms, ref_norms)
    policy.export_hf(f"{out_root}/export")
    if rank == 0:
        _check_export(f"{out_root}/export", path, ref_weights)
    print(f"[head padding] tiny llama: max |grad diff| per step = {worst}, grad norms {norms} vs {ref_norms}")


def _check_export(out_dir: str, original_dir: str, ref_weights: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import load_file

    exported, original = load_file(f"{out_dir}/model.safetensors"), load_file(f"{original_dir}/model.safetensors")
    assert exported.keys() == ref_weights.keys() == original.keys()
    assert all(exported[k].shape == original[k].shape for k in original)
    diff = max((exported[k] - ref_weights[k]).abs().max().item() for k in original)
    moved = max((exported[k] - original[k]).abs().max().item() for k in original)
    assert diff <= WEIGHT_ATOL and moved > 100 * WEIGHT_ATOL, (diff, moved)
    config = json.loads(open(f"{out_dir}/config.json").read())
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (6, 3)
    print(f"[head padding] export after 2 steps: max |TP=2 padded - TP=1| = {diff:.3e} (weights moved {moved:.2e})")


def _smollm2_worker(rank: int, world_size: int) -> None:
    policy = _build(SMOLLM2, 2, pad_attention_heads=True)
    assert (policy.model.config.num_attention_heads, policy.model.config.num_query_groups) == (12, 4)
    check_logits(policy, load_hf_model(SMOLLM2), f"{SMOLLM2} tp=2 padded")
    check_hf_weights(policy, SMOLLM2, f"{SMOLLM2} tp=2 padded")


def test_smollm2_tp2_with_head_padding_matches_transformers():
    run_distributed(_smollm2_worker, 2)


def test_padded_heads_stay_zero_and_training_matches_tp1(tmp_path):
    run_distributed(_tiny_worker, 2, str(tmp_path))


def _resume_worker(rank: int, world_size: int, root: str) -> None:
    path, folder = f"{root}/hf", f"{root}/run/checkpoints/step_000001"
    padded = _build(path, 2, pad_attention_heads=True)
    padded.train_step(make_batch(rows=ROWS, seed=5), LOSS)  # the optimizer's state exists from the first step on
    padded.save_checkpoint(folder, {"step": 1})
    with pytest.raises(ValueError) as error:
        _build(path, 1, pad_attention_heads=True).load_checkpoint(folder)
    _check_refusal(str(error.value), folder)
    assert _build(path, 2, pad_attention_heads=True).load_checkpoint(folder) == {"step": 1}  # the fix


def _check_refusal(message: str, folder: str) -> None:
    for part in ("parallel.tp_size=2, whose attention heads are padded to 4 KV groups (8 heads)",
                 "at parallel.tp_size=1 this model has 3 (6 heads)", "resume with parallel.tp_size=2",
                 f"checkpoint_export {folder}` drops the padding", f"model.name_or_path={folder}/hf"):  # fmt: skip
        assert part in message, message


def test_a_resume_at_a_tp_size_of_other_padding_is_refused_before_loading(tmp_path):
    """Checkpoints keep the padded layout: TP=2 pads 3 KV groups to 4, TP=1 has 3. The job's first check and the
    load refuse it naming both and the fixes, instead of Megatron's global-shape mismatch."""
    from gtpo_megatron.config import load_config
    from gtpo_megatron.megatron_adapter.validation import validate_config

    _save_three_group_llama(str(tmp_path / "hf"))
    run_distributed(_resume_worker, 2, str(tmp_path))
    run = [f"model={tmp_path}/hf", f"output_dir={tmp_path}/run", "resume=true", "model.pad_attention_heads=true"]
    with pytest.raises(ValueError) as error:
        validate_config(load_config(None, [*run, "rollout.max_tokens=64"]), 2)
    _check_refusal(str(error.value), f"{tmp_path}/run/checkpoints/step_000001")
    validate_config(load_config(None, [*run, "rollout.max_tokens=64", "parallel.tp_size=2"]), 2)
