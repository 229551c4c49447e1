"""Routing replay's layouts: ``TrainBatch.routed_experts`` through every micro-batch cut, into a router's token order,
and ``LayerReplay``'s choice between the replayed and the router's own experts (no Megatron model needed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from gtpo_megatron.batch import TrainBatch
from gtpo_megatron.megatron_adapter.micro_batching import budget_micro_batches, fixed_micro_batches
from gtpo_megatron.megatron_adapter.moe.routing_replay import LayerReplay, recomputes_routers, router_targets
from gtpo_megatron.plan.micro_batches import TokenBudget

CPU = torch.device("cpu")
LENGTHS = [5, 2, 7, 3]
LAYERS, TOP_K = 2, 2


def _code(input_ids: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
    """``[b, S, L, K]`` int16 record that names its token: ``4 * id + 2 * layer + k + 1``, 0 off the tokens."""
    layer_k = torch.arange(LAYERS)[:, None] * 2 + torch.arange(TOP_K)[None]
    code = input_ids[..., None, None] * 4 + layer_k + 1
    return (code * token_mask[..., None, None]).to(torch.int16)


def _batch() -> TrainBatch:
    columns = torch.arange(8)
    token_mask = columns[None] < torch.tensor(LENGTHS)[:, None]
    input_ids = torch.arange(1, 33).reshape(4, 8) * token_mask
    return TrainBatch(
        input_ids=input_ids,
        token_mask=token_mask,
        response_mask=token_mask & (columns[None] >= 2),
        advantages=torch.tensor([0.5, -1.0, 2.0, 0.25]),
        routed_experts=_code(input_ids, token_mask),
    )


@pytest.mark.parametrize("cut", ["fixed", "padded", "packed"])
def test_routed_experts_follow_their_tokens_through_every_micro_batch_cut(cut):
    batch = _batch()
    if cut == "fixed":
        micro_batches = fixed_micro_batches(batch, 3, width_multiple=4, backend="local", device=CPU)
    else:
        budget = TokenBudget(max_tokens=10, packing=cut == "packed")
        micro_batches = budget_micro_batches(batch, budget, width_multiple=4, backend="local", device=CPU)
    for micro_batch in micro_batches:
        routed = micro_batch.routed_experts
        assert routed.dtype == torch.int16 and routed.shape == (*micro_batch.input_ids.shape, LAYERS, TOP_K)
        assert torch.equal(routed, _code(micro_batch.input_ids, micro_batch.token_mask)), cut  # padding: 0
        unpacked = micro_batch.unpacked()
        assert torch.equal(unpacked.routed_experts, _code(unpacked.input_ids, unpacked.token_mask)), cut


def test_router_targets_are_sequence_major_and_cut_by_sequence_parallel_rank():
    routed_bSLK = torch.arange(2 * 4 * LAYERS * TOP_K, dtype=torch.int16).reshape(2, 4, LAYERS, TOP_K) + 1
    full = router_targets(routed_bSLK, 1, (0, 1))
    assert full.shape == (8, TOP_K) and full.dtype == torch.int64
    for token in range(8):
        s, b = divmod(token, 2)  # Megatron's [S, b] flattened
        assert torch.equal(full[token], routed_bSLK[b, s, 1].long() - 1)
    second = router_targets(routed_bSLK, 1, (1, 2))  # sequence parallel rank 1 of 2: positions 2 and 3
    assert torch.equal(second, full[4:])


def _own_topk(scores, topk, num_groups=None, group_topk=None):
    return torch.topk(scores, k=topk, dim=1)


def test_layer_replay_takes_recorded_experts_and_keeps_own_topk_elsewhere():
    scores = torch.tensor([[4.0, 3.0, 2.0, 1.0], [1.0, 2.0, 3.0, 4.0]], requires_grad=True)
    replay = LayerReplay(0, recompute=False)
    replay.target = torch.tensor([[2, 3], [-1, -1]])
    values, experts = replay.get_replay_topk(scores, 2, None, None, _own_topk)
    assert experts.tolist() == [[2, 3], [3, 2]]
    assert values.tolist() == [[2.0, 1.0], [4.0, 3.0]]
    values.sum().backward()  # the router's scores get the gradient of the replayed experts
    assert scores.grad.tolist() == [[0, 0, 1, 1], [0, 0, 1, 1]]
    assert replay.agreement.tolist() == [0.0, 1.0]  # one recorded token, not the router's own choice


def test_layer_replay_recompute_replays_the_forward_experts_in_order():
    replay = LayerReplay(0, recompute=True)
    replay.training = True
    scores = torch.tensor([[4.0, 3.0, 2.0, 1.0]])
    first, second = torch.tensor([[0, 1]]), torch.tensor([[2, 3]])
    with torch.no_grad():  # Megatron's checkpointed forwards run without gradients
        for target in (first, second):
            replay.target = target
            replay.get_replay_topk(scores, 2, None, None, _own_topk)
    replay.target = None
    for expected in (first, second):  # the backward's recomputes, with gradients, in forward order
        _, experts = replay.get_replay_topk(scores, 2, None, None, _own_topk)
        assert torch.equal(experts, expected)
    assert not replay.pending


def test_layer_replay_refuses_a_target_of_another_token_count():
    replay = LayerReplay(3, recompute=False)
    replay.target = torch.zeros(3, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="layer 3: replayed experts"):
        replay.get_replay_topk(torch.zeros(2, 4), 2, None, None, _own_topk)


@pytest.mark.parametrize(
    "granularity, modules, rerun",
    [("full", ["core_attn"], True), ("selective", ["core_attn"], False), ("selective", ["moe"], True),
     (None, ["moe"], False), ("selective", None, False)],
)  # fmt: skip
def test_routers_are_recomputed_under_full_or_selective_moe_recompute(granularity, modules, rerun):
    config = SimpleNamespace(recompute_granularity=granularity, recompute_modules=modules)
    assert recomputes_routers(config) is rerun
