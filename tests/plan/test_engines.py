"""Engine placement (``plan/engines.py``): counts, leaders, devices, prompt shares and CPU core bindings, by hand."""

from __future__ import annotations

import pytest

from gtpo_megatron.plan.engines import (
    engine_count_problems,
    engine_placements,
    engine_prompt_range,
    resolve_num_engines,
    split_cores,
    visible_devices,
)


def _placements(**changes):
    kwargs = dict(placement="colocated", num_engines=8, engine_tp_size=8, train_world_size=64, ranks_per_node=8,
                  pool_gpus=0, accelerator=True)  # fmt: skip
    kwargs.update(changes)
    return engine_placements(**kwargs)


@pytest.mark.parametrize(
    ("placement", "world", "tp", "gpus", "accelerator", "expected"),
    [
        ("colocated", 64, 8, None, True, 8),  # the 70B recipe: every GPU generates
        ("colocated", 16, 2, None, True, 8),
        ("colocated", 2, 1, None, False, 1),  # CPU: one engine
        ("separate", 6, 2, None, True, 1),  # separate: engine_tp_size GPUs by default
        ("separate", 12, 2, 4, True, 2),
    ],
)
def test_auto_fills_the_gpus(placement, world, tp, gpus, accelerator, expected):
    got = resolve_num_engines("auto", placement=placement, train_world_size=world, engine_tp_size=tp,
                              num_engine_gpus=gpus, accelerator=accelerator)  # fmt: skip
    assert got == expected
    assert resolve_num_engines(3, placement=placement, train_world_size=world, engine_tp_size=tp,
                               num_engine_gpus=gpus, accelerator=accelerator) == 3  # fmt: skip


def test_colocated_engine_i_takes_the_gpus_of_its_ranks():
    placements = _placements()
    assert [p.leader_rank for p in placements] == [0, 8, 16, 24, 32, 40, 48, 56]
    assert placements[3].ranks == tuple(range(24, 32)) and placements[3].devices == tuple(range(8))
    assert placements[1].describe() == (
        "engine 1 of 8 (leader rank 8, ranks [8, 9, 10, 11, 12, 13, 14, 15], GPUs [0, 1, 2, 3, 4, 5, 6, 7])"
    )
    # fewer engines than auto: spread one per world/N ranks, each on the first engine_tp of them
    two = _placements(num_engines=2, engine_tp_size=2, train_world_size=8)
    assert [(p.leader_rank, p.ranks, p.devices) for p in two] == [(0, (0, 1), (0, 1)), (4, (4, 5), (4, 5))]
    # tp 2 on nodes of 4 ranks: engine 3 (ranks 6, 7) sits on node 1, local GPUs 2 and 3
    nodes = _placements(num_engines=4, engine_tp_size=2, train_world_size=8, ranks_per_node=4)
    assert nodes[3].ranks == (6, 7) and nodes[3].devices == (2, 3)


def test_separate_engines_take_the_gpus_training_does_not_use():
    """Separate placement: 6 training ranks on 8 GPUs, engine TP 2 -> the engine on GPUs 6 and 7 (not 0 and 1)."""
    (only,) = _placements(placement="separate", num_engines=1, engine_tp_size=2, train_world_size=6,
                          ranks_per_node=6, pool_gpus=2)  # fmt: skip
    assert (only.leader_rank, only.ranks, only.devices) == (0, (0,), (6, 7))
    # siblings: two engines on one node's 4 spare GPUs; two nodes of 6 ranks with 2 engine GPUs each
    pair = _placements(placement="separate", num_engines=2, engine_tp_size=2, train_world_size=4, ranks_per_node=4,
                       pool_gpus=4)  # fmt: skip
    assert [(p.leader_rank, p.devices) for p in pair] == [(0, (4, 5)), (1, (6, 7))]
    spread = _placements(placement="separate", num_engines=2, engine_tp_size=2, train_world_size=12,
                         ranks_per_node=6, pool_gpus=4)  # fmt: skip
    assert [(p.leader_rank, p.devices) for p in spread] == [(0, (6, 7)), (6, (6, 7))]


def test_cpu_leaders_are_spread_and_have_no_devices():
    assert [(p.leader_rank, p.devices) for p in _placements(num_engines=2, train_world_size=2,
                                                             accelerator=False)] == [(0, ()), (1, ())]  # fmt: skip
    assert [p.leader_rank for p in _placements(num_engines=2, train_world_size=4, accelerator=False)] == [0, 2]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"num_engines": 3},
            r"rollout.num_engines=3 x rollout.engine_tp_size=8 = 24 GPUs must divide the world size "
            r"\(64, rollout.placement=colocated\); use rollout.num_engines=auto or one of \[1, 2, 4, 8\]",
        ),
        (
            {"num_engines": 3, "train_world_size": 2, "accelerator": False},
            r"num_engines=3 .* must divide the world size \(2,",
        ),
        (
            {"placement": "separate", "num_engines": 2, "engine_tp_size": 2, "pool_gpus": 2},
            r"must divide the engine pool \(2,",
        ),
        (
            {"num_engines": 4, "engine_tp_size": 4, "train_world_size": 16, "ranks_per_node": 6},
            r"engine 1 would span ranks \[4, 5, 6, 7\]",
        ),
        (
            {
                "placement": "separate",
                "num_engines": 3,
                "engine_tp_size": 1,
                "train_world_size": 12,
                "ranks_per_node": 6,
                "pool_gpus": 3,
            },
            r"do not spread evenly over 2 node",
        ),
    ],
)
def test_layouts_that_do_not_tile_are_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        _placements(**changes)


def test_count_rule_holds_for_good_layouts():
    assert engine_count_problems(8, placement="colocated", train_world_size=64, engine_tp_size=8, pool_gpus=0) == []
    assert engine_count_problems(2, placement="separate", train_world_size=6, engine_tp_size=1, pool_gpus=2) == []
    assert engine_count_problems(0, placement="colocated", train_world_size=2, engine_tp_size=1, pool_gpus=0) == [
        "rollout.num_engines=0 must be >= 1 or auto"
    ]


@pytest.mark.parametrize(
    ("num_prompts", "num_engines", "expected"),
    [
        (4, 2, [range(0, 2), range(2, 4)]),
        (5, 2, [range(0, 3), range(3, 5)]),  # the first engine takes the extra group
        (7, 3, [range(0, 3), range(3, 5), range(5, 7)]),
        (1, 2, [range(0, 1), range(1, 1)]),  # an engine may get nothing
        (3, 1, [range(0, 3)]),
    ],
)
def test_prompts_are_dealt_as_contiguous_balanced_blocks(num_prompts, num_engines, expected):
    shares = [engine_prompt_range(num_prompts, num_engines=num_engines, index=i) for i in range(num_engines)]
    assert shares == expected
    assert [i for share in shares for i in share] == list(range(num_prompts))


@pytest.mark.parametrize(
    ("cores", "slot", "engines", "tp", "expected"),
    [
        ([0, 1], 0, 2, 1, "0"),  # two colocated engines on the 2-core machine: one core each
        ([0, 1], 1, 2, 1, "1"),
        ([0, 1, 2, 3], 1, 2, 2, "2|3"),  # vLLM's format: one list per worker
        ([0, 1, 2, 3, 4, 5], 0, 2, 1, "0,1,2"),
        ([5], 1, 2, 1, "5"),  # more engines than cores: they share
    ],
)
def test_colocated_cpu_engines_get_their_own_cores(cores, slot, engines, tp, expected):
    split = split_cores(cores, num_trainer_ranks=0, num_engines=engines, engine_tp_size=tp)
    assert split.trainers == () and split.engine_binding(slot) == expected


@pytest.mark.parametrize(
    ("cores", "ranks", "engines", "tp", "trainers", "workers"),
    [
        ([0, 1], 1, 1, 1, ((0,),), ((1,),)),  # the CPU demo: one training rank, one separate engine
        (list(range(8)), 1, 1, 1, ((0, 1, 2, 3),), ((4, 5, 6, 7),)),
        (list(range(8)), 2, 1, 2, ((0, 1), (2, 3)), ((4, 5), (6, 7))),  # 2 ranks, one engine of 2 workers
        (list(range(7)), 2, 1, 1, ((0, 1, 2), (3, 4)), ((5, 6),)),  # the first shares take the remainder
        ([4, 9, 10], 1, 2, 1, ((4,),), ((9,), (10,))),  # the node's own core ids, in order
        ([0, 1], 2, 1, 1, ((0,), (1,)), ((0,),)),  # fewer cores than shares: round-robin, shared
    ],
)
def test_separate_cpu_engines_and_training_ranks_get_disjoint_cores(cores, ranks, engines, tp, trainers, workers):
    split = split_cores(cores, num_trainer_ranks=ranks, num_engines=engines, engine_tp_size=tp)
    assert (split.trainers, split.engine_workers) == (trainers, workers)
    if len(cores) >= ranks + engines * tp:  # every core in exactly one share
        assert sorted(c for share in (*trainers, *workers) for c in share) == sorted(cores)


def test_an_engines_cores_and_binding_cover_its_workers():
    split = split_cores(list(range(10)), num_trainer_ranks=2, num_engines=2, engine_tp_size=2)
    assert split.trainers == ((0, 1), (2, 3))
    assert split.engine_workers == ((4, 5), (6, 7), (8,), (9,))
    assert [split.engine_binding(e) for e in (0, 1)] == ["4,5|6,7", "8|9"]
    assert [split.engine_cores(e) for e in (0, 1)] == [(4, 5, 6, 7), (8, 9)]


def test_the_worker_on_rank_0s_gpu_is_fed_by_a_relay_only_when_colocated_on_gpus():
    from gtpo_megatron.plan.engines import relay_workers

    gpu = _placements()  # 8 colocated engines of 8: engine 0's worker 0 shares rank 0's GPU
    assert relay_workers(gpu, placement="colocated", engine_tp_size=8, accelerator=True) == (1, 0)
    single_gpu_engines = _placements(num_engines=2, engine_tp_size=1, train_world_size=2)
    assert relay_workers(single_gpu_engines, placement="colocated", engine_tp_size=1, accelerator=True) == (1, 0)
    assert relay_workers(gpu, placement="separate", engine_tp_size=8, accelerator=True) is None
    assert relay_workers(gpu, placement="colocated", engine_tp_size=8, accelerator=False) is None  # gloo on CPU
    one = _placements(num_engines=1, engine_tp_size=1, train_world_size=1, ranks_per_node=1)
    with pytest.raises(ValueError, match="use rollout.weight_sync=files"):
        relay_workers(one, placement="colocated", engine_tp_size=1, accelerator=True)


def test_engine_devices_are_read_through_the_nodes_visible_list():
    """Slurm gives a job half of a node (CUDA_VISIBLE_DEVICES=4,5,6,7): local GPU 2 is the physical GPU 6."""
    assert visible_devices((2, 3), None) == "2,3" and visible_devices((2, 3), "") == "2,3"
    assert visible_devices((2, 3), "4,5,6,7") == "6,7"
    assert visible_devices((0,), "GPU-aa, GPU-bb") == "GPU-aa"  # UUIDs pass through
    with pytest.raises(ValueError, match=r"GPUs \[2, 3\], but CUDA_VISIBLE_DEVICES=4,5 shows 2.*at least 4 GPUs"):
        visible_devices((2, 3), "4,5")
