"""Mixture-of-experts policies on 2 gloo ranks vs the single-process ``transformers`` models.

Tiny random Qwen3-MoE (renormalised top-2 of 4 experts, q/k norms), Qwen2-MoE (un-renormalised top-2, a shared
expert with its sigmoid gate, q/k/v biases) and Mixtral (``block_sparse_moe`` names), built from configs. For each,
at TP=1 EP=1 (DP=2), TP=1 EP=2 (each rank holds 2 experts) and TP=2 EP=2 with sequence parallelism:

* the vocab-parallel logits equal the HF logits (fp32, ``megatron_helpers.LOGITS_ATOL``);
* the weight stream (export and vLLM sync source) gives back every HF tensor, every expert included, ``torch.equal``;

and for each at the EP=2 layouts, with 1 and 2 micro-batches per rank: the GTPO loss equals the
reference loss, every local gradient shard (each rank's experts, the router, the shared expert's TP shards) equals
the HF gradient sliced by the same conversion (atol 1e-5), Megatron's global gradient norm equals the reference
norm, the step's expert loads (``moe_expert_load_max`` / ``_min``) equal the HF routers' top-k counts over every
rank's forward tokens, and ``compute_logprobs`` equals the float64 reference. Then ``model.moe_aux_loss_coeff > 0``
leaves the GTPO loss unchanged, logs ``moe_aux_loss`` and changes the routers' gradients, on ranks with 4 and 2
micro-batches (the shorter list is completed with idle micro-batches, without which the EP exchange would hang).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.adapter.megatron_helpers import (
    DictReader,
    check_hf_weights,
    check_logits,
    load_hf_model,
    make_batch,
    megatron_named_params,
    model_section,
    reference_grads,
    reference_token_logprobs,
    save_random_hf_model,
    settings_at,
)
from tests.helpers.dist_harness import run_distributed
from tests.helpers.tiny_configs import tiny_moe

pytestmark = pytest.mark.distributed

ROWS = 4
GRAD_ATOL = 1e-5
LOGPROB_ATOL = 1e-5
LAYOUTS = ((1, 1), (1, 2), (2, 2))  # (tp, ep); sequence parallelism at tp 2 (Megatron's MoE layer needs it)
MODELS = ("qwen3_moe", "qwen2_moe", "mixtral")  # tiny_moe's, each trained at ep 2


def _build(path: str, tp: int, ep: int, model=None):
    from gtpo_megatron.megatron_adapter.policy import MegatronPolicy
    from gtpo_megatron.parallel.groups import init_distributed

    groups = init_distributed(tp_size=tp, pp_size=1, ep_size=ep)
    model = model or model_section(path, make_vocab_size_divisible_by=100)
    settings = settings_at(groups, model, sequence_parallel=tp > 1)
    return MegatronPolicy.from_pretrained(settings, groups=groups)


def _checkpoint_names(grads: dict[str, torch.Tensor], moe) -> dict[str, torch.Tensor]:
    """HF gradients under the checkpoint's names: transformers 5 holds a layer's experts fused
    (``experts.gate_up_proj`` ``[E, 2F, H]``, gate rows first; ``experts.down_proj`` ``[E, H, F]``) and Mixtral's
    ``block_sparse_moe`` under ``mlp``."""
    named = {}
    for name, grad in grads.items():
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
        if name.endswith(".experts.gate_up_proj"):
            for expert, fused in enumerate(grad):
                gate, up = fused.chunk(2)
                named |= {moe.hf_expert_name(layer, expert, 0): gate, moe.hf_expert_name(layer, expert, 1): up}
        elif name.endswith(".experts.down_proj"):
            named |= {moe.hf_expert_name(layer, expert, 2): down for expert, down in enumerate(grad)}
        else:  # Mixtral's router: in memory under mlp, in the checkpoint under block_sparse_moe
            named[name.replace(".mlp.gate.", f".{moe.block}.gate.")] = grad
    return named


def _check_training(policy, hf_model, label: str) -> None:
    from gtpo_megatron.megatron_adapter import hf_conversion, hf_loading
    from gtpo_megatron.megatron_adapter.optimizer import global_grad_norm
    from gtpo_megatron.ops import LossSpec

    batch = make_batch(rows=ROWS, seq_len=12, vocab_size=hf_model.config.vocab_size, seed=5)
    with torch.no_grad():
        ref_logprobs, _ = reference_token_logprobs(hf_model, batch)
    batch.old_logprobs = (ref_logprobs.float() + 0.3 * torch.randn(batch.input_ids.shape)) * batch.response_mask
    ref_loss, ref_grads = reference_grads(hf_model, batch, loss_name="gtpo", aggregation="token-mean")
    groups, share = policy.groups, ROWS // policy.groups.dp_size
    local = batch.select(slice(groups.dp_rank * share, (groups.dp_rank + 1) * share))
    spec = LossSpec(loss_name="gtpo", aggregation="token-mean", clip_eps_low=0.2, clip_eps_high=0.2)
    ref_norm = torch.sqrt(sum((g.double() ** 2).sum() for g in ref_grads.values())).item()
    reader = DictReader(_checkpoint_names(ref_grads, policy.geometry.moe.family))
    for micro_batch_size in (share, share // 2):
        policy.micro_batch_size = micro_batch_size
        policy.zero_grad()
        metrics = policy.forward_backward(local, spec)
        assert abs(metrics["loss"] - ref_loss) <= 1e-6, (label, metrics["loss"], ref_loss)
        worst = 0.0
        for name, param in megatron_named_params(policy):
            mapping = hf_conversion.param_mapping(name, policy.geometry)
            expected = hf_loading.shard_from_hf(mapping, reader, policy.geometry, groups.tp_rank)
            diff = (param.main_grad - expected).abs().max().item()
            assert diff <= GRAD_ATOL, f"{label} mbs={micro_batch_size}: grad of {name} differs by {diff}"
            worst = max(worst, diff)
        norm = global_grad_norm(policy.optimizer)
        assert abs(norm - ref_norm) <= 1e-5 * ref_norm, f"{label}: grad norm {norm} vs reference {ref_norm}"
        print(f"[moe grad parity] {label} micro_batch_size={micro_batch_size}: max |grad diff| = {worst:.3e}")
    _check_router_load(policy, hf_model, local, metrics, label)
    logprobs, _ = policy.compute_logprobs(local)
    rows = ref_logprobs[groups.dp_rank * share : (groups.dp_rank + 1) * share]
    assert (logprobs.double() - rows).abs().max().item() <= LOGPROB_ATOL, label


def _check_router_load(policy, hf_model, local, metrics, label: str) -> None:
    """The step's expert loads equal the HF routers' top-k counts over every rank's forward tokens."""
    inputs = [mb.input_ids for mb in policy._micro_batches(local)]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, inputs)
    moe = policy.geometry.moe
    counts = torch.zeros(hf_model.config.num_hidden_layers, moe.num_experts, dtype=torch.float64)
    with torch.no_grad():
        for input_ids in (ids for rank_inputs in gathered for ids in rank_inputs):
            router_logits = hf_model(input_ids, output_router_logits=True).router_logits
            for layer, logits in enumerate(router_logits):
                chosen = logits.reshape(-1, moe.num_experts).topk(moe.top_k, dim=-1).indices
                counts[layer] += torch.bincount(chosen.flatten(), minlength=moe.num_experts)
    if policy.groups.tp_size > 1:  # both TP ranks hold the same rows: each routes its half of the sequence
        counts /= policy.groups.tp_size
    load = counts / (counts.sum(dim=1, keepdim=True) / moe.num_experts)
    expected = (load.max().item(), load.min().item())
    got = (metrics["moe_expert_load_max"], metrics["moe_expert_load_min"])
    assert got == pytest.approx(expected, abs=1e-9), (label, got, expected)
    assert "moe_aux_loss" not in metrics  # model.moe_aux_loss_coeff = 0: no load-balancing loss


def _check_aux_loss(path: str, label: str) -> None:
    """``model.moe_aux_loss_coeff > 0``: the GTPO loss is unchanged, the load-balancing loss is logged (about 1 for a
    near-balanced router: ``E * sum_e f_e P_e``) and its gradient reaches the routers."""
    from gtpo_megatron.ops import LossSpec

    spec = LossSpec(loss_name="gtpo", aggregation="token-mean", clip_eps_low=0.2, clip_eps_high=0.2)
    results = []
    for coeff in (0.0, 0.5):
        policy = _build(
            path, 1, 2, model=model_section(path, make_vocab_size_divisible_by=100, moe_aux_loss_coeff=coeff)
        )
        batch = make_batch(rows=ROWS, seq_len=12, vocab_size=300, seed=5)
        share = ROWS // policy.groups.dp_size
        metrics = policy.forward_backward(batch.select(slice(policy.groups.dp_rank * share, None)), spec)
        router = [p.main_grad.clone() for n, p in megatron_named_params(policy) if n.endswith("router.weight")]
        results.append((metrics, router))
    (plain, plain_router), (balanced, balanced_router) = results
    assert balanced["loss"] == pytest.approx(plain["loss"], abs=1e-7), label
    assert 0.5 < balanced["moe_aux_loss"] < 2.0 and "moe_aux_loss" not in plain, (label, balanced)
    assert all((a - b).abs().max() > 1e-6 for a, b in zip(plain_router, balanced_router)), label


def _worker(rank: int, world_size: int, out_root: str) -> None:
    if rank == 0:
        for name in MODELS:
            save_random_hf_model(f"{out_root}/{name}", tiny_moe(name))
    dist.barrier()
    for name in MODELS:
        path, hf_model = f"{out_root}/{name}", load_hf_model(f"{out_root}/{name}")
        for tp, ep in LAYOUTS:
            label = f"{name} tp={tp} ep={ep}"
            policy = _build(path, tp, ep)
            check_logits(policy, hf_model, label)
            check_hf_weights(policy, path, label)
            if ep == 2:
                _check_training(policy, hf_model, label)
    _check_aux_loss(f"{out_root}/qwen3_moe", "qwen3_moe aux loss")


def test_moe_models_match_transformers_at_every_expert_layout(tmp_path):
    run_distributed(_worker, 2, str(tmp_path))
