"""Rollout routing replay (``megatron_adapter.moe.routing_replay``) on 2 gloo ranks at EP=2, tiny random Qwen3-MoE.

4 experts, renormalised top-2, 2 layers, built from a config; each rank holds 2 experts. The checks:

(a) replaying the trainer's own routing (recorded from its routers) gives the logits and every local gradient
    shard of the no-replay run;
(b) replaying a forced routing (each recorded expert moved to the next one, the last column of every row left
    unrecorded) gives logits equal (fp32, 1e-5) to a float64 ``transformers`` forward whose routers take the same
    experts (their weights still from their own softmax), and logits far from the no-replay ones: the test fails if
    replay is ignored;
(c) with ``model.recompute=full`` (every layer's forward re-runs in the backward) the forced routing gives the
    gradients of (b)'s run without recompute: the recompute replays the same experts; so do packed token-budget
    micro-batches (``optim.packing``: rows reordered and packed into one row each);
(d) at TP=2 EP=2 with sequence parallelism (each rank routes half of every sequence) and at PP=2 (each stage's
    routers pick their own layers), a random routing replayed gives the float64 reference's logits;
(e) at PP=2 (1F1B over 4 micro-batches: the first stage runs two forwards before its first backward) full
    recompute gives the gradients of the run without it: each recompute replays its own micro-batch's experts, not
    the last ones set.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from gtpo_megatron.plan.micro_batches import TokenBudget
from tests.adapter.megatron_helpers import (
    load_hf_model,
    make_batch,
    megatron_logits,
    megatron_named_params,
    model_section,
    save_random_hf_model,
    settings_at,
)
from tests.helpers.dist_harness import run_distributed
from tests.helpers.tiny_configs import EXPERTS as TINY_EXPERTS
from tests.helpers.tiny_configs import TINY, tiny_moe

pytestmark = pytest.mark.distributed

ROWS, SEQ_LEN = 4, 12
EXPERTS, TOP_K = TINY_EXPERTS["num_experts"], TINY_EXPERTS["num_experts_per_tok"]
LOGITS_ATOL = 1e-5  # fp32 Megatron against a float64 reference of the same routing


def _build(path: str, tp: int = 1, ep: int = 2, pp: int = 1, **model_fields):
    from gtpo_megatron.megatron_adapter.policy import MegatronPolicy
    from gtpo_megatron.parallel.groups import init_distributed

    groups = init_distributed(tp_size=tp, pp_size=pp, ep_size=ep)
    model = model_section(path, make_vocab_size_divisible_by=100, **model_fields)
    settings = settings_at(groups, model, routing_replay=True, sequence_parallel=tp > 1)
    return MegatronPolicy.from_pretrained(settings, groups=groups)


def _own_routing(policy, input_ids: torch.Tensor) -> torch.Tensor:
    """``[B, S, L, K]`` int16 experts + 1 the policy's routers choose for ``input_ids`` (hooks on its routers)."""
    from megatron.core.transformer.moe.router import TopKRouter

    chosen, handles = {}, []

    def record(router, inputs, outputs):
        experts = outputs[1].float().topk(TOP_K, dim=1).indices.sort(dim=1).values  # routing map -> ids
        chosen[router.layer_number - 1] = experts.reshape(SEQ_LEN, -1, TOP_K).transpose(0, 1)

    for module in policy.model.modules():
        if isinstance(module, TopKRouter):
            handles.append(module.register_forward_hook(record))
    policy.routing_replay.set_micro_batch(None)
    megatron_logits(policy, input_ids)
    for handle in handles:
        handle.remove()
    return (torch.stack([chosen[layer] for layer in sorted(chosen)], dim=2) + 1).to(torch.int16)


def _replayed_logits(policy, input_ids: torch.Tensor, routed: torch.Tensor | None) -> torch.Tensor:
    policy.routing_replay.set_micro_batch(routed)
    logits = megatron_logits(policy, input_ids)
    policy.routing_replay.set_micro_batch(None)
    return logits


def _grads(policy, batch, routed: torch.Tensor | None) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    from gtpo_megatron.ops import LossSpec

    share = ROWS // policy.groups.dp_size
    rows = slice(policy.groups.dp_rank * share, (policy.groups.dp_rank + 1) * share)
    local = batch.select(rows)
    local.routed_experts = None if routed is None else routed[rows]
    spec = LossSpec(loss_name="gtpo", aggregation="token-mean", clip_eps_low=0.2, clip_eps_high=0.2)
    policy.zero_grad()
    metrics = policy.forward_backward(local, spec)
    return metrics, {name: p.main_grad.clone() for name, p in megatron_named_params(policy)}


def _reference_logits(hf_model, input_ids: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
    """float64 ``transformers`` logits with each router's top-k replaced by ``routed`` where recorded."""
    model = hf_model.double()
    model.config._experts_implementation = "eager"  # the grouped-GEMM path has no float64 kernel
    experts_BSLK = routed.long() - 1

    def forced_gate(gate, layer):
        def forward(hidden_states):
            logits = torch.nn.functional.linear(hidden_states.reshape(-1, gate.hidden_dim), gate.weight)
            probs = torch.softmax(logits, dim=-1)
            own = probs.topk(gate.top_k, dim=-1).indices
            target = experts_BSLK[:, :, layer].reshape(-1, gate.top_k)
            experts = torch.where(target[:, :1] >= 0, target, own)
            weights = probs.gather(1, experts)
            return logits, weights / weights.sum(dim=-1, keepdim=True), experts

        return forward

    for layer, block in enumerate(model.model.layers):
        block.mlp.gate.forward = forced_gate(block.mlp.gate, layer)
    with torch.no_grad():
        return model(input_ids).logits


def _worker(rank: int, world_size: int, out_root: str) -> None:
    path = f"{out_root}/qwen3_moe"
    if rank == 0:
        save_random_hf_model(path, tiny_moe("qwen3_moe"))
    dist.barrier()
    policy = _build(path)
    hf_model = load_hf_model(path)  # after the MoE policy: transformers loads with moe.compat's CPU stream installed
    batch = make_batch(rows=ROWS, seq_len=SEQ_LEN, vocab_size=TINY["vocab_size"], seed=5)
    plain_logits = _replayed_logits(policy, batch.input_ids, None)
    own = _own_routing(policy, batch.input_ids)
    # (a) the trainer's own routing replayed: same logits, same gradient shards
    own_logits = _replayed_logits(policy, batch.input_ids, own)
    diff_a = (own_logits - plain_logits).abs().max().item()
    plain_metrics, plain_grads = _grads(policy, batch, None)
    own_metrics, own_grads = _grads(policy, batch, own)
    grad_a = max((own_grads[n] - g).abs().max().item() for n, g in plain_grads.items())
    assert diff_a <= 1e-6 and grad_a <= 1e-6, (diff_a, grad_a)
    assert own_metrics["mismatch/routing_agreement"] == 1.0, own_metrics
    assert "mismatch/routing_agreement" not in plain_metrics
    # (b) a forced routing: each expert moved to the next, the last column of every row unrecorded
    forced = ((own.long() - 1 + 1) % EXPERTS + 1).to(torch.int16)
    forced[:, -1] = 0
    forced_logits = _replayed_logits(policy, batch.input_ids, forced)
    reference = _reference_logits(copy.deepcopy(hf_model), batch.input_ids, forced)
    diff_b = (forced_logits.double() - reference).abs().max().item()
    moved = (forced_logits - plain_logits).abs().max().item()
    assert diff_b <= LOGITS_ATOL, diff_b
    assert moved > 1e-2, f"forced routing did not change the logits ({moved}): replay ignored"
    forced_metrics, forced_grads = _grads(policy, batch, forced)
    # layer 0 never agrees; layer 1 routes hidden states that layer 0's forced experts changed, so by chance only
    assert forced_metrics["mismatch/routing_agreement"] < 0.1, forced_metrics
    # (c) full recompute replays the same experts in the backward's second forward; packing moves them along
    policy.token_budget = TokenBudget(max_tokens=2 * SEQ_LEN, packing=True)
    _, packed_grads = _grads(policy, batch, forced)
    grad_packed = max((packed_grads[n] - g).abs().max().item() for n, g in forced_grads.items())
    assert grad_packed <= 1e-6, grad_packed
    recomputed = _build(path, recompute="full")
    _, recomputed_grads = _grads(recomputed, batch, forced)
    grad_c = max((recomputed_grads[n] - g).abs().max().item() for n, g in forced_grads.items())
    assert grad_c <= 1e-6, grad_c
    # (d) sequence parallelism and pipeline stages: a random routing replayed
    chosen = torch.rand(ROWS, SEQ_LEN, TINY["num_hidden_layers"], EXPERTS, generator=torch.Generator().manual_seed(1))
    random = (chosen.argsort(dim=-1)[..., :TOP_K] + 1).to(torch.int16)
    reference = _reference_logits(copy.deepcopy(hf_model), batch.input_ids, random)
    layouts = {}
    for tp, ep, pp in ((2, 2, 1), (1, 1, 2)):
        staged = _build(path, tp, ep, pp)
        logits = _replayed_logits(staged, batch.input_ids, random)
        if logits is not None:  # the last stage; vocabulary shard of this TP rank
            start = (rank % tp) * logits.shape[-1]
            real = min(logits.shape[-1], TINY["vocab_size"] - start)  # columns past the vocabulary are padding
            diff = logits[..., :real].double() - reference[..., start : start + real]
            layouts[(tp, ep, pp)] = diff.abs().max().item()
            assert layouts[(tp, ep, pp)] <= LOGITS_ATOL, layouts
    # (e) 1F1B at PP=2 runs both forwards before the first backward: each recompute replays its own micro-batch
    _, staged_grads = _grads(staged, batch, random)
    _, recomputed_grads = _grads(_build(path, 1, 1, 2, recompute="full"), batch, random)
    grad_e = max((recomputed_grads[n] - g).abs().max().item() for n, g in staged_grads.items())
    assert grad_e <= 1e-6, grad_e
    print(
        f"[routing replay parity] rank {rank}: own |dlogits| {diff_a:.2e}, |dgrad| {grad_a:.2e}; forced vs float64 "
        f"reference |dlogits| {diff_b:.2e} (vs no replay {moved:.2e}); recompute |dgrad| {grad_c:.2e}, packed "
        f"|dgrad| {grad_packed:.2e}; random routing |dlogits| at (tp, ep, pp) {layouts}; PP=2 recompute |dgrad| "
        f"{grad_e:.2e}"
    )


def test_routing_replay_matches_own_and_forced_routing(tmp_path):
    run_distributed(_worker, 2, str(tmp_path))
