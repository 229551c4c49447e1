"""Routed experts from the engine leaders to every rank (``rollout.exchange``) and into ``TrainBatch`` rows.

The sum of the leaders' wires is the all-reduce's; one test runs it on 2 gloo ranks (uint8 and int32 wires).
"""

from __future__ import annotations

import pytest
import torch

from gtpo_megatron.rollout.batch import collate_completions
from gtpo_megatron.rollout.exchange import (
    RoutingLayout,
    RowLayout,
    ScoredGroup,
    attach_routed_experts,
    pack_routed_experts,
    pack_rows,
    unpack_rows,
)
from gtpo_megatron.rollout.types import Completion, PromptCompletions
from tests.helpers.dist_harness import run_distributed

LAYOUT = RowLayout(max_prompt_len=4, max_tokens=5)
LAYERS, TOP_K = 3, 2


def _completion(tokens: list[int], fed: int, seed: int, num_experts: int) -> Completion:
    gen = torch.Generator().manual_seed(seed)
    routed = torch.randint(0, num_experts, (fed, LAYERS, TOP_K), generator=gen).to(torch.int16)
    return Completion(token_ids=tokens, rollout_logprobs=[-0.5] * len(tokens), text="", finish_reason="stop",
                      routed_experts=routed)  # fmt: skip


def _group(prompt: list[int], lengths: list[int], seed: int, num_experts: int) -> ScoredGroup:
    completions = [
        _completion(list(range(7, 7 + n)), len(prompt) + n - 1, seed + j, num_experts) for j, n in enumerate(lengths)
    ]
    return ScoredGroup(PromptCompletions(prompt, completions), [1.0, 0.0], [True, False], [True, True])


@pytest.mark.parametrize("num_experts, dtype", [(8, torch.uint8), (254, torch.uint8), (300, torch.int32)])
def test_routed_experts_of_two_leaders_sum_to_every_completion(num_experts, dtype):
    routing = RoutingLayout(num_layers=LAYERS, top_k=TOP_K, num_experts=num_experts)
    assert routing.dtype == dtype
    first, second = {0: _group([1, 2, 3], [5, 2], 0, num_experts)}, {1: _group([4, 5], [1, 3], 10, num_experts)}
    wires = [
        pack_routed_experts(slots, num_groups=2, group_size=2, layout=LAYOUT, routing=routing)
        for slots in (first, second)
    ]
    assert wires[0].shape == (4, 9, LAYERS, TOP_K) and wires[0].dtype == dtype
    rows = sum(pack_rows(s, num_groups=2, group_size=2, layout=LAYOUT) for s in (first, second))
    gathered = unpack_rows(rows, group_size=2, layout=LAYOUT)
    attach_routed_experts(wires[0] + wires[1], gathered.groups)  # the SUM all-reduce of the two leaders
    sent = [c for s in (first, second) for g in s.values() for c in g.completions.completions]
    got = [c for g in gathered.groups for c in g.completions]
    for original, received in zip(sent, got, strict=True):
        assert received.routed_experts.dtype == torch.int16
        assert torch.equal(received.routed_experts, original.routed_experts)  # expert 0 included, shape [n, L, K]


def test_collation_shifts_ids_by_one_and_leaves_unrecorded_columns_zero():
    group = _group([1, 2, 3], [5, 2], 0, 8).completions
    batch = collate_completions([group], pad_token_id=0)
    assert batch.routed_experts.shape == (2, 8, LAYERS, TOP_K) and batch.routed_experts.dtype == torch.int16
    for row, completion in enumerate(group.completions):
        fed = completion.routed_experts.shape[0]
        assert torch.equal(batch.routed_experts[row, :fed], completion.routed_experts + 1)
        assert not batch.routed_experts[row, fed:].any()  # the last token and the padding: no record
    group.completions[1].routed_experts = None
    with pytest.raises(ValueError, match="1 of 2 completions carry no routed experts"):
        collate_completions([group], pad_token_id=0)
    group.completions[0].routed_experts = None
    assert collate_completions([group], pad_token_id=0).routed_experts is None


def test_routed_experts_of_the_wrong_shape_are_refused():
    routing = RoutingLayout(num_layers=LAYERS, top_k=TOP_K, num_experts=8)
    group = _group([1, 2, 3], [5, 2], 0, 8)
    group.completions.completions[1].routed_experts = torch.zeros(4, LAYERS + 1, TOP_K, dtype=torch.int16)
    with pytest.raises(ValueError, match=r"completion 1: routed experts of shape \(4, 4, 2\), expected \[n <= 9, 3"):
        pack_routed_experts({0: group}, num_groups=1, group_size=2, layout=LAYOUT, routing=routing)
    group.completions.completions[1].routed_experts = None
    with pytest.raises(ValueError, match="routed experts of shape None"):
        pack_routed_experts({0: group}, num_groups=1, group_size=2, layout=LAYOUT, routing=routing)


def _share_worker(rank: int, world_size: int) -> None:
    import torch.distributed as dist

    from gtpo_megatron.parallel.collectives import all_reduce_sum

    for num_experts in (8, 300):
        routing = RoutingLayout(num_layers=LAYERS, top_k=TOP_K, num_experts=num_experts)
        slots = [{0: _group([1, 2, 3], [5, 2], 0, num_experts)}, {1: _group([4, 5], [1, 3], 10, num_experts)}]
        wire = pack_routed_experts(slots[rank], num_groups=2, group_size=2, layout=LAYOUT, routing=routing)
        rows = pack_rows(slots[rank], num_groups=2, group_size=2, layout=LAYOUT)
        gathered = unpack_rows(all_reduce_sum(rows, group=dist.group.WORLD), group_size=2, layout=LAYOUT)
        attach_routed_experts(all_reduce_sum(wire, group=dist.group.WORLD), gathered.groups)
        sent = [c for s in slots for g in s.values() for c in g.completions.completions]
        got = [c for g in gathered.groups for c in g.completions]
        assert all(torch.equal(a.routed_experts, b.routed_experts) for a, b in zip(sent, got, strict=True))


@pytest.mark.distributed
def test_routed_experts_cross_a_gloo_all_reduce():
    run_distributed(_share_worker, 2)
