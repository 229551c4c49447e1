"""The routers' load-balancing and z-losses weigh each micro-batch by its tokens, however the rows were cut (2 ranks).

Tiny random Qwen3-MoE, ``model.moe_aux_loss_coeff`` and ``moe_z_loss_coeff`` > 0, one row per micro-batch. The same
four rows (of unequal lengths) are trained cut unequally over two data-parallel ranks (1 and 3 micro-batches; at
EP=2 the first rank runs 2 idle copies of its row) and cut evenly (2 and 2): every gradient shard agrees between the
two cuts, at EP=1 and at EP=2 with full recompute (each recompute takes its own micro-batch's weight). The routers'
gradients equal a float64 single-process reference, ``sum_m r_m / R grad(l_m)`` over the four rows (``l_m``:
Megatron's switch and z-losses of row ``m``, ``r_m`` its real tokens), there and at PP=2, whose 1F1B schedule runs
the second micro-batch's forward before the first one's backward. The GTPO loss adds nothing (every token weight 0),
so the gradients are the router losses' alone.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.adapter.megatron_helpers import (
    DictReader,
    load_hf_model,
    make_batch,
    megatron_named_params,
    model_section,
    save_random_hf_model,
    settings_at,
)
from tests.helpers.dist_harness import run_distributed
from tests.helpers.tiny_configs import tiny_moe

pytestmark = pytest.mark.distributed

AUX, Z = 0.5, 0.1
CUTS = {"unequal": 1, "even": 2}  # rows of rank 0 (rank 1 takes the rest); one row per micro-batch
LAYOUTS = ((1, 1, "none"), (1, 2, "full"), (2, 1, "none"))  # (pp, ep, model.recompute)
ATOL = 1e-6


def _build(path: str, pp: int, ep: int, recompute: str):
    from gtpo_megatron.megatron_adapter.policy import MegatronPolicy
    from gtpo_megatron.parallel.groups import init_distributed

    groups = init_distributed(tp_size=1, pp_size=pp, ep_size=ep)
    coefficients = dict(moe_aux_loss_coeff=AUX, moe_z_loss_coeff=Z, recompute=recompute)
    model = model_section(path, make_vocab_size_divisible_by=100, **coefficients)
    return MegatronPolicy.from_pretrained(settings_at(groups, model, micro_batch_size=1), groups=groups)


def _batch():
    batch = make_batch(rows=4, seq_len=12, vocab_size=300, seed=5)
    batch.old_logprobs = torch.zeros(batch.input_ids.shape)
    batch.token_weights = torch.zeros(batch.input_ids.shape)
    return batch


def _grads(policy, batch, first_rows: int) -> dict[str, torch.Tensor]:
    from gtpo_megatron.ops import LossSpec

    spec = LossSpec(loss_name="gtpo", aggregation="token-mean", clip_eps_low=0.2, clip_eps_high=0.2)
    rank, dp = policy.groups.dp_rank, policy.groups.dp_size
    rows = slice(None) if dp == 1 else slice(0, first_rows) if rank == 0 else slice(first_rows, None)
    policy.zero_grad()
    policy.forward_backward(batch.select(rows), spec)
    return {name: param.main_grad.clone() for name, param in megatron_named_params(policy)}


def reference_router_grads(hf_model, batch) -> dict[str, torch.Tensor]:
    """float64 ``grad sum_m r_m / R l_m`` of every router (HF names), one row ``m`` per micro-batch."""
    model = hf_model.double()
    model.set_experts_implementation("eager")  # the grouped GEMM takes no float64
    model.zero_grad(set_to_none=True)
    k, experts = model.config.num_experts_per_tok, model.config.num_experts
    tokens = batch.token_mask.sum(dim=1).double()
    total = torch.zeros((), dtype=torch.float64)
    for row in range(batch.input_ids.shape[0]):
        for logits in model(batch.input_ids[row : row + 1], output_router_logits=True).router_logits:
            logits = logits.reshape(-1, experts)
            scores = logits.softmax(dim=-1)
            routed = torch.zeros_like(scores).scatter(1, scores.topk(k, dim=1).indices, 1.0)
            switch = (scores.sum(0) * routed.sum(0)).sum() * experts / (k * logits.shape[0] ** 2)
            z_loss = logits.logsumexp(dim=-1).square().mean()
            total = total + tokens[row] / tokens.sum() * (AUX * switch + Z * z_loss)
    total.backward()
    return {name: p.grad for name, p in model.named_parameters() if name.endswith("mlp.gate.weight")}


def _worker(rank: int, world_size: int, root: str) -> None:
    from gtpo_megatron.megatron_adapter import hf_conversion, hf_loading

    if rank == 0:
        save_random_hf_model(root, tiny_moe("qwen3_moe"))
    dist.barrier()
    batch = _batch()
    reader = DictReader(reference_router_grads(load_hf_model(root), batch))
    for pp, ep, recompute in LAYOUTS:
        policy = _build(root, pp, ep, recompute)
        unequal, even = (_grads(policy, batch, first_rows) for first_rows in CUTS.values())
        cut_diff = max((unequal[name] - even[name]).abs().max().item() for name in even)
        ref_diff = 0.0
        for name, grad in unequal.items():
            if name.endswith("router.weight"):
                mapping = hf_conversion.param_mapping(name, policy.geometry)
                expected = hf_loading.shard_from_hf(mapping, reader, policy.geometry, 0).float()
                ref_diff = max(ref_diff, (grad - expected).abs().max().item())
        worst = torch.tensor([cut_diff, ref_diff])
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        label = f"pp={pp} ep={ep} recompute={recompute}"
        if rank == 0:
            print(f"[router loss weights] {label}: unequal vs even cut {worst[0]:.3e}, vs float64 {worst[1]:.3e}")
        assert worst[0] <= ATOL and worst[1] <= ATOL, (label, worst.tolist())
        routers = [g for n, g in even.items() if n.endswith("router.weight")]
        assert routers and max(g.abs().max().item() for g in routers) > 1e-3


def test_router_losses_weigh_micro_batches_by_tokens_however_cut(tmp_path):
    run_distributed(_worker, 2, str(tmp_path / "qwen3_moe"))
