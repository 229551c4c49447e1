"""``rollout.fault_tolerance``: a failed engine's prompts move with their seeds, it restarts and rejoins at a sync.

Ranks are threads (``ft_fakes.ThreadWorld``); every rank must end with the rollout an undisturbed run gets.
"""

from __future__ import annotations

import pytest

from gtpo_megatron.config import load_config
from gtpo_megatron.rollout.fault_tolerance import deal
from tests.rollout.ft_fakes import WAIT_S, FaultyEngine, Rank, ThreadWorld, ft_config


def _rows(rollout):
    return [[c.token_ids for c in g.completions] for g in rollout.groups], rollout.scores, rollout.rewards


def _run(monkeypatch, faults: list[FaultyEngine], steps: int = 1, *extra: str, sync: bool = False):
    """Each rank's ``(rank, rollouts)`` of ``steps`` steps (with a weight sync after each when ``sync``)."""
    cfg, log = ft_config(len(faults), *extra), []
    world = ThreadWorld(len(faults), monkeypatch)
    ranks = [Rank(cfg, r, faults[r], log) for r in range(len(faults))]

    def fn(rank):
        out = []
        for step in range(1, steps + 1):
            out.append(ranks[rank].step(step))
            if sync and step < steps:
                restarting = ranks[rank].ft._restarting
                if restarting is not None:  # the restart runs in the background; here it must be done first
                    assert restarting[0].finished(WAIT_S)
                out.append(ranks[rank].ft.sync(lambda: iter(())))
        return out

    return ranks, world.run(fn), log


def _undisturbed(monkeypatch, num_engines: int, steps: int = 1):
    _, results, _ = _run(monkeypatch, [FaultyEngine() for _ in range(num_engines)], steps)
    return [_rows(r) for r in results[0]]


def test_deal_gives_contiguous_balanced_blocks_to_the_live_engines():
    assert deal([0, 1, 2, 3, 4], [0, 2]) == {0: [0, 1, 2], 2: [3, 4]}
    assert deal([5, 7], [1, 2, 3]) == {1: [5], 2: [7], 3: []}


@pytest.mark.parametrize("fault", ["die", "stop", "hang"])
def test_a_failed_engines_prompts_move_with_their_seeds_and_it_rejoins_with_the_current_weights(monkeypatch, fault):
    expected = _undisturbed(monkeypatch, 2, steps=2)
    ranks, results, log = _run(monkeypatch, [FaultyEngine(), FaultyEngine(fault)], steps=2, sync=True)
    for rank, (first, synced, second) in enumerate(results):
        assert not isinstance(first, BaseException), first
        assert [_rows(first), _rows(second)] == expected, f"rank {rank}"  # the same completions, none lost or twice
        assert first.stats["rollout/engines_alive"] == 1 and first.stats["rollout/requests_moved"] == 2
        assert first.stats["rollout/engine_restarts"] == 1
        assert synced["rollout/recovery_s"] >= 0 and second.stats["rollout/engines_alive"] == 2
        assert second.stats["rollout/requests_moved"] == 0
    survivor, restarted = ranks[0].collector.engine.engine, ranks[1].restarted
    assert survivor.prompt_indices == [[0, 1], [2, 3], [0, 1]]  # its block, the failed one's, then its own
    assert len(restarted) == 1 and ranks[1].collector.engine.engine is restarted[0]
    assert restarted[0].received == 1 and restarted[0].prompt_indices == [[2, 3]]  # weights first, then samples
    assert log == [(0, 1)] * 2  # one new weight group with the restarted engine (each rank's part)


def test_an_engine_that_dies_during_a_weight_sync_is_dropped_and_the_survivor_gets_the_update_whole(monkeypatch):
    ranks, results, log = _run(monkeypatch, [FaultyEngine(), FaultyEngine("sync_death")], steps=2, sync=True)
    assert all(not isinstance(r, BaseException) for r in results), results
    assert log == [(0,)] * 2  # a weight group without the dead engine at once (each rank's part)
    survivor = ranks[0].collector.engine.engine
    assert survivor.received == 2  # the failed sync's partial update is replaced by a whole one
    assert results[0][1]["sync/num_tensors"] == 1.0
    assert results[0][2].stats["rollout/engine_restarts"] == 1
    assert results[0][2].stats["rollout/engines_alive"] == 1 and results[0][2].stats["rollout/requests_moved"] == 2


def test_two_engines_failing_in_one_step_leave_the_whole_step_to_the_third(monkeypatch):
    expected = _undisturbed(monkeypatch, 3)
    faults = [FaultyEngine(), FaultyEngine("die"), FaultyEngine("die", at=2)]  # engine 2 dies on the moved prompts
    ranks, results, _ = _run(monkeypatch, faults)
    for (rollout,) in results:
        assert not isinstance(rollout, BaseException), rollout
        assert [_rows(rollout)] == expected
        assert rollout.stats["rollout/engines_alive"] == 1 and rollout.stats["rollout/engine_restarts"] == 2
        assert rollout.stats["rollout/requests_moved"] == 3  # engine 1's two prompts, then engine 2's one of them
    assert ranks[0].collector.engine.engine.prompt_indices == [[0, 1], [2], [3]]
    assert ranks[2].collector.engine.engine.prompt_indices[0] == [4, 5]


def test_the_job_stops_naming_the_engine_when_its_restarts_are_spent(monkeypatch):
    _, results, _ = _run(monkeypatch, [FaultyEngine(), FaultyEngine("die")], 1, "rollout.max_restarts=0")
    for error in results:
        assert isinstance(error, RuntimeError), error
        assert "engine 1 of 2 (leader rank 1" in str(error) and "rollout.max_restarts=0 restarts spent" in str(error)


def test_the_job_stops_when_no_engine_is_left(monkeypatch):
    _, results, _ = _run(monkeypatch, [FaultyEngine("die"), FaultyEngine("die")])
    for error in results:
        assert isinstance(error, RuntimeError) and "no engine is left of 2" in str(error), error
        assert "engine 0 of 2" in str(error) and "engine 1 of 2" in str(error)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["rollout.num_engines=1"], "rollout.fault_tolerance/rollout.num_engines"),
        (["rollout.num_engines=2", "rollout.max_restarts=-1"], "rollout.max_restarts"),
        (["rollout.num_engines=2", "rollout.health_check_timeout_s=60", "rollout.timeout_s=30"],
         "rollout.health_check_timeout_s"),
        (["rollout.num_engines=2", "rollout.health_check_interval_s=0"], "rollout.health_check_interval_s"),
        (["rollout.num_engines=2", "rollout.health_check_first_wait_s=-1"], "rollout.health_check_first_wait_s"),
        (["rollout.num_engines=2", "rollout.placement=separate", "rollout.mode=async", "rollout.partial_rollouts=true",
          "rollout.weight_sync=sharded"], "rollout.fault_tolerance/rollout.weight_sync"),
    ],
)  # fmt: skip
def test_bad_fault_tolerance_settings_name_the_field_and_a_fix(overrides, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.") + "=") as caught:
        load_config(None, ["model=builtin:tiny-qwen2", "rollout.fault_tolerance=true", *overrides])
    assert "; " in str(caught.value)  # rule; fix
