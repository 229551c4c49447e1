"""Layout arithmetic: padded vocabulary, derived sizes, and one readable error per broken rule."""

from __future__ import annotations

import pytest

from gtpo_megatron.parallel.groups import init_distributed
from gtpo_megatron.plan.architectures import KNOWN_ARCHITECTURES
from gtpo_megatron.plan.layout import check_layout, padded_vocab_size, world_problems
from tests.helpers.dist_harness import run_distributed

LLAMA70B = KNOWN_ARCHITECTURES["Llama-3.1-70B-Instruct"]  # 64 heads, 8 KV heads, 80 layers
QWEN25_32B = KNOWN_ARCHITECTURES["Qwen2.5-32B-Instruct"]  # 40 heads, 8 KV heads, 64 layers


def _layout(arch=LLAMA70B, **changes):
    kwargs = dict(world_size=64, tp_size=8, pp_size=4, engine_tp_size=8, placement="colocated", num_prompts=16,
                  group_size=8, micro_batch_size=1, make_vocab_size_divisible_by=128)  # fmt: skip
    kwargs.update(changes)
    return check_layout(arch, **kwargs)


@pytest.mark.parametrize(
    ("vocab", "tp", "expected"),
    [
        (128256, 8, 129024),  # multiple of 1024: 125.25 -> 126 * 1024
        (151936, 8, 152576),  # 148.375 -> 149 * 1024
        (152064, 4, 152064),  # multiple of 512 already: 297 * 512
        (49152, 2, 49152),  # 192 * 256
        (49152, 3, 49152),  # 128 * 384
        (49152, 1, 49152),  # the policy's cases (one owner: megatron_adapter.policy imports this function)
        (49153, 2, 49408),
        (151936, 4, 152064),
    ],
)
def test_padded_vocab_size(vocab: int, tp: int, expected: int) -> None:
    assert padded_vocab_size(vocab, make_vocab_size_divisible_by=128, tp_size=tp) == expected


def test_colocated_layout_sizes() -> None:
    layout = _layout()
    # 64 ranks / (tp 8 * pp 4) = dp 2; 16 prompts * 8 = 128 sequences, 64 per dp rank, 64 micro-batches of 1;
    # num_engines=auto: 64 / engine tp 8 = 8 engines, each decoding 2 whole groups = 16 sequences
    assert (layout.dp_size, layout.sequences_per_step, layout.sequences_per_dp_rank) == (2, 128, 64)
    assert (layout.num_microbatches, layout.num_engines, layout.sequences_per_engine) == (64, 8, 16)
    one = _layout(num_engines=1)
    assert (one.num_engines, one.sequences_per_engine) == (1, 128)
    uneven = _layout(num_prompts=17, group_size=8, world_size=64, micro_batch_size=4)  # 17 groups over 8 engines
    assert uneven.sequences_per_engine == 3 * 8  # the busiest engine takes 3 whole groups
    assert layout.padded_vocab_size == 129024


def test_separate_layout_gives_the_engine_its_own_ranks() -> None:
    layout = _layout(world_size=40, placement="separate")
    assert (layout.train_world_size, layout.dp_size, layout.num_engines, layout.sequences_per_engine) == (
        32, 1, 1, 128)  # fmt: skip


@pytest.mark.parametrize(
    ("arch", "changes", "message"),
    [
        (
            LLAMA70B,
            {"tp_size": 16, "world_size": 64},
            r"parallel.tp_size=16 must divide num_attention_heads=64 "
            r"and num_query_groups=8 .*use one of \[1, 2, 4, 8\]",
        ),
        (QWEN25_32B, {"tp_size": 16, "pp_size": 4}, r"num_attention_heads=40 .*use one of \[1, 2, 4, 8\]"),
        (LLAMA70B, {"pp_size": 3, "world_size": 48}, r"parallel.pp_size=3 must divide num_layers=80"),
        (LLAMA70B, {"engine_tp_size": 3, "world_size": 96}, r"rollout.engine_tp_size=3 must divide"),
        (LLAMA70B, {"engine_tp_size": 16}, r"rollout.engine_tp_size=16 exceeds the 8 GPUs the engine can use"),
        (LLAMA70B, {"world_size": 60}, r"--gpus=60 leaves 60 training ranks, not a multiple of .*=8\*4"),
        (
            LLAMA70B,
            {"world_size": 36, "placement": "separate", "engine_tp_size": 8},
            r"--gpus=36 leaves 28 training ranks.*launch 32\*k \+ 8 GPUs",
        ),
        (
            QWEN25_32B,
            {"tp_size": 4, "pp_size": 1, "num_prompts": 3},
            r"rollout.num_prompts\*algorithm.group_size=3\*8=24 must split evenly over dp_size=16; "
            r"use rollout.num_prompts=4",
        ),
        (
            LLAMA70B,
            {"num_prompts": 3, "micro_batch_size": 8},
            r"optim.micro_batch_size=8 must divide the 12 sequences per data-parallel rank",
        ),
    ],  # fmt: skip
)
def test_broken_rules_name_field_value_and_fix(arch, changes, message) -> None:
    with pytest.raises(ValueError, match=message):
        _layout(arch, **changes)


def test_all_problems_are_reported_together() -> None:
    with pytest.raises(ValueError) as info:
        _layout(tp_size=16, pp_size=3, world_size=64)
    text = str(info.value)
    assert text.count("\n  - ") == 3  # tp, pp and the world size (64 is not a multiple of 16*3)
    assert "parallel.tp_size=16" in text and "parallel.pp_size=3" in text and "--gpus=64" in text


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        ((1, 1, 0), "parallel.tp_size/pp_size/ep_size=1/1/0 must each be >= 1; use 1"),
        (
            (1, 2, 3),
            "parallel.ep_size=3 must divide the 4 ranks of a pipeline stage (the world size 8, parallel.pp_size=2); "
            "use one of [1, 2, 4]",
        ),
        ((2, 2, 2), ""),
    ],
)  # fmt: skip
def test_world_problems_hold_the_expert_parallel_rule(sizes, message) -> None:
    tp, pp, ep = sizes
    found = world_problems(8, tp_size=tp, pp_size=pp, ep_size=ep, described="the world size 8", launch="8 ranks")
    assert found == ([message] if message else [])


def _init_with_ep(rank: int, world_size: int, ep_size: int) -> None:
    with pytest.raises(ValueError, match=rf"parallel.ep_size={ep_size} must divide the {world_size} ranks of a"):
        init_distributed(ep_size=ep_size)


def test_the_process_groups_refuse_by_the_same_rule() -> None:
    run_distributed(_init_with_ep, 2, 3)
