"""Partial rollouts over several engines, with ``rollout.fault_tolerance``: every push pauses each live engine around
the whole weight sync and labels the new version; an engine lost mid-batch or mid-sync is not resumed, its prompts
move to the survivor (sampled from scratch with the weights the survivor holds then), and the restarted engine is
labelled with the version it was admitted at.

Ranks are threads (``ft_fakes.ThreadWorld``) running the trainer's async loop (take, push: no drain).
"""

from __future__ import annotations

import pytest

from tests.rollout.ft_fakes import PartialEngine, Rank, ThreadWorld, ft_config

PARTIAL = ("rollout.placement=separate", "rollout.mode=async", "rollout.partial_rollouts=true",
           "algorithm.off_policy_correction=tis")  # fmt: skip


def _rows(rollout):
    """The step's prompts and completions, group by group (a lost, repeated or moved prompt changes them)."""
    return [(list(g.prompt_ids), [c.token_ids for c in g.completions]) for g in rollout.groups], rollout.rewards


def _run(monkeypatch, faults: list[PartialEngine], steps: int = 4, k: int = 1):
    cfg = ft_config(len(faults), *PARTIAL, f"rollout.max_staleness={k}", f"trainer.max_steps={steps}")
    world = ThreadWorld(len(faults), monkeypatch)
    ranks = [Rank(cfg, r, faults[r], []) for r in range(len(faults))]
    return ranks, world.run(lambda rank: ranks[rank].run_async())


def test_every_push_pauses_each_engine_around_the_whole_sync_and_labels_the_new_version(monkeypatch):
    engines = [PartialEngine(), PartialEngine()]
    _, results = _run(monkeypatch, engines)
    for out in results:
        assert not isinstance(out, BaseException), out
        assert [("async/pause_s" in metrics) for _, metrics in out] == [True, True, False, False]
    for engine in engines:  # the start label, then the weights after steps 1 and 2 (batches 3 and 4 take them)
        assert engine.log == ["resume0", "pause", "receive", "resume1", "pause", "receive", "resume2"]


@pytest.mark.parametrize(
    ("fault", "at", "faulty_log"),
    [
        # dies sampling batch 2 (batch 3, queued on it after the push, fails too): found at take 2
        ("die", 2, ["resume0", "pause", "receive", "resume1"]),
        # dies receiving the weights after step 1 while paused: never resumed
        ("sync_death", 1, ["resume0", "pause", "receive"]),
    ],
)
def test_an_engine_lost_with_partial_rollouts_loses_no_prompt_and_its_restart_is_labelled(
    monkeypatch, fault, at, faulty_log
):
    _, expected = _run(monkeypatch, [PartialEngine(), PartialEngine()])
    faulty = PartialEngine(fault, at=at)
    ranks, results = _run(monkeypatch, [PartialEngine(), faulty])
    for rank, out in enumerate(results):
        assert not isinstance(out, BaseException), out
        assert [_rows(r) for r, _ in out] == [_rows(r) for r, _ in expected[0]], f"rank {rank}"  # none lost or twice
        stats = [r.stats for r, _ in out]
        assert stats[-1]["rollout/engine_restarts"] == 1 and stats[-1]["rollout/engines_alive"] == 2
        assert sum(s["rollout/requests_moved"] for s in stats) >= 2
    assert faulty.log == faulty_log
    (restarted,) = ranks[1].restarted
    assert restarted.log == ["receive", "resume2"]  # admitted at the sync after step 2, labelled, never paused
    survivor = ranks[0].collector.engine.engine
    assert survivor.version == restarted.version == 2 and restarted.served  # it sampled batch 4's share
    for engine in (survivor, restarted, faulty):  # batch j sampled with the newest weights of its time, >= j - 2
        assert all(version >= max(0, step - 2) for step, version in engine.served), engine.served


def test_a_batch_the_lost_engine_had_served_is_sampled_again_by_its_restart_and_counted_once(monkeypatch):
    """k = 2: batches 1-3 start together; engine 1 serves 1 and 3, dies on 2 (found at take 2) and is admitted at
    the push after step 2; its shares of batches 3 and 4, queued before the loss, are sampled again by the restart."""
    per_engine = ("rollout/tokens_per_engine_min", "rollout/tokens_per_engine_max")
    _, expected = _run(monkeypatch, [PartialEngine(), PartialEngine()], steps=5, k=2)
    faulty = PartialEngine("die", at=2, after=(1, 3))
    ranks, results = _run(monkeypatch, [PartialEngine(), faulty], steps=5, k=2)
    (restarted,) = ranks[1].restarted
    assert sorted(faulty.served) == [(1, 0), (3, 0)] and sorted(restarted.served) == [(3, 2), (4, 2), (5, 2)]
    for out in results:
        assert not isinstance(out, BaseException), out
        assert [_rows(r) for r, _ in out] == [_rows(r) for r, _ in expected[0]]  # the same completions again
        for step in (3, 4, 5):  # the lost engine's batch-3 tokens are not counted beside the restart's
            got, undisturbed = out[step - 1][0].stats, expected[0][step - 1][0].stats
            assert [got[key] for key in per_engine] == [undisturbed[key] for key in per_engine], step
