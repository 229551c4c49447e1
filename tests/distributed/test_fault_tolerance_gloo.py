"""``rollout.fault_tolerance`` on two gloo ranks, each leading an engine: engine 1 dies in step 1, engine 0 samples
its prompts with their seeds, both ranks agree on the step (equal to the undisturbed run's, the reference computed
by the same ranks first) and on the loss, and engine 1 rejoins at the weight sync before step 2; the same in async
mode (k = 1), engine 1 dying while it samples the batch queued ahead, and with partial rollouts (no drain: the
engines pause around each sync and label the new version)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tests.helpers.dist_harness import run_distributed
from tests.rollout.ft_fakes import WAIT_S, FaultyEngine, PartialEngine, Rank, ft_config

pytestmark = pytest.mark.distributed


def _rows(rollout):
    return [[c.token_ids for c in g.completions] for g in rollout.groups], rollout.scores, rollout.rewards


def _two_steps(rank: int, fault: str | None) -> tuple[list, dict, Rank]:
    cfg = ft_config(2)
    me = Rank(cfg, rank, FaultyEngine(fault if rank == 1 else None), [], group=dist.group.WORLD)
    first = me.step(1)
    if me.ft._restarting is not None:
        assert me.ft._restarting[0].finished(WAIT_S)
    synced = me.ft.sync(lambda: iter(()))
    return [first, me.step(2)], synced, me


def _check(rank: int, world_size: int) -> None:
    (first, second), _, _ = _two_steps(rank, None)
    expected = [_rows(first), _rows(second)]
    assert first.stats["rollout/engines_alive"] == 2 and first.stats["rollout/requests_moved"] == 0

    (first, second), synced, me = _two_steps(rank, "die")
    assert [_rows(first), _rows(second)] == expected  # no prompt lost, none twice, the same samples
    assert first.stats == {**first.stats, "rollout/engines_alive": 1.0, "rollout/engine_restarts": 1.0,
                           "rollout/requests_moved": 2.0}  # fmt: skip
    assert "rollout/recovery_s" in synced and second.stats["rollout/engines_alive"] == 2
    if rank == 1:
        assert me.restarted[0].received == 1 and me.restarted[0].prompt_indices == [[2, 3]]
    else:
        assert me.collector.engine.engine.prompt_indices == [[0, 1], [2, 3], [0, 1]]


def _check_async(rank: int, world_size: int) -> None:
    async_cfg = ("rollout.placement=separate", "rollout.mode=async", "trainer.max_steps=4")
    undisturbed = Rank(ft_config(2, *async_cfg), rank, FaultyEngine(), [], group=dist.group.WORLD).run_async()
    faulty = FaultyEngine("die" if rank == 1 else None, at=2)  # dies sampling batch 2 while step 1 trains
    me = Rank(ft_config(2, *async_cfg), rank, faulty, [], group=dist.group.WORLD)
    out = me.run_async()
    assert [_rows(r) for r, _ in out] == [_rows(r) for r, _ in undisturbed]  # no prompt lost, none twice
    assert [r.stats["rollout/engines_alive"] for r, _ in out] == [2, 1, 2, 2]
    assert out[-1][0].stats["rollout/engine_restarts"] == 1 and out[1][0].stats["rollout/requests_moved"] == 2
    engines = [faulty, *me.restarted]
    assert all(version == max(0, step - 2) for engine in engines for step, version in engine.served)
    if rank == 1:  # back at the first sync with the weights after step 1, then sampling batches 3 and 4
        assert me.restarted[0].served == [(3, 1), (4, 2)]


def _check_partial(rank: int, world_size: int) -> None:
    partial_cfg = ("rollout.placement=separate", "rollout.mode=async", "rollout.partial_rollouts=true",
                   "algorithm.off_policy_correction=tis", "trainer.max_steps=4")  # fmt: skip
    undisturbed = Rank(ft_config(2, *partial_cfg), rank, PartialEngine(), [], group=dist.group.WORLD).run_async()
    faulty = PartialEngine("die" if rank == 1 else None, at=2)
    me = Rank(ft_config(2, *partial_cfg), rank, faulty, [], group=dist.group.WORLD)
    out = me.run_async()
    assert [_rows(r) for r, _ in out] == [_rows(r) for r, _ in undisturbed]  # no prompt lost, none twice
    assert [r.stats["rollout/engines_alive"] for r, _ in out] == [2, 1, 2, 2]
    if rank == 1:  # paused and labelled at the first push, lost at take 2, back (labelled 2) at the second push
        assert faulty.log == ["resume0", "pause", "receive", "resume1"]
        assert me.restarted[0].log == ["receive", "resume2"]


def _check_both(rank: int, world_size: int) -> None:
    _check(rank, world_size)
    _check_async(rank, world_size)
    _check_partial(rank, world_size)


def test_two_ranks_agree_on_a_failed_engine_and_finish_the_step_without_it_in_sync_and_async_mode():
    run_distributed(_check_both, 2)  # one job for the three modes (each start of the ranks costs seconds)
