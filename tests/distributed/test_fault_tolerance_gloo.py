"""``rollout.fault_tolerance`` on two gloo ranks, each leading an engine: engine 1 dies in step 1, engine 0 samples
its prompts with their seeds, both ranks agree on the step (equal to the undisturbed run's, the reference computed
by the same ranks first) and on the loss, and engine 1 rejoins at the weight sync before step 2."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tests.helpers.dist_harness import run_distributed
from tests.rollout.ft_fakes import WAIT_S, FaultyEngine, Rank, ft_config

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


def test_two_ranks_agree_on_a_failed_engine_and_finish_the_step_without_it():
    run_distributed(_check, 2)
