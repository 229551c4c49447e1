"""``rollout.fault_tolerance`` in async mode (``rollout/async_recovery.py``): an engine that fails mid-batch is
dropped, its queued prompts move to the survivor with their seeds and their batch's weights, and it rejoins at a
weight sync with the current weights.

Ranks are threads (``ft_fakes.ThreadWorld``) running the trainer's async loop (take, drain, push); every rank must
end with the rollouts an undisturbed run gets. Batch j is queued with the weights after step max(0, j - 1 - k).
"""

from __future__ import annotations

import pytest

from tests.rollout.ft_fakes import FaultyEngine, Rank, ThreadWorld, ft_config


def _rows(rollout):
    """The step's prompts and completions, group by group (a lost, repeated or moved prompt changes them)."""
    groups = [(list(g.prompt_ids), [c.token_ids for c in g.completions]) for g in rollout.groups]
    return groups, rollout.scores, rollout.rewards


def _run(monkeypatch, faults: list[FaultyEngine], k: int, steps: int):
    """The ranks and each one's ``[(rollout, push metrics) per step]`` (``Rank.run_async``)."""
    cfg = ft_config(len(faults), "rollout.placement=separate", "rollout.mode=async", f"rollout.max_staleness={k}",
                    f"trainer.max_steps={steps}")  # fmt: skip
    world = ThreadWorld(len(faults), monkeypatch)
    ranks = [Rank(cfg, r, faults[r], []) for r in range(len(faults))]
    return ranks, world.run(lambda rank: ranks[rank].run_async())


@pytest.mark.parametrize(
    ("k", "fault", "at", "steps"),
    [
        (1, "die", 2, 4),  # dies sampling batch 2 while step 1 trains: found at the drain before the first sync
        (1, "die", 1, 4),  # dies in batch 1: found at its take, the survivor busy with batch 2
        (2, "die", 2, 5),  # batch 3 was queued on it too: it moves whole
        (1, "stop", 2, 4),  # stopped (SIGSTOP): its health check fails
        (2, "hang", 3, 5),  # hangs silently: the health check does not answer
        (1, "sync_death", 1, 4),  # dies receiving the weights after step 1: batch 3 is dealt to the survivor alone
    ],
)
def test_an_engine_failing_mid_batch_in_async_mode_leaves_the_undisturbed_batches(monkeypatch, k, fault, at, steps):
    _, expected = _run(monkeypatch, [FaultyEngine(), FaultyEngine()], k, steps)
    faults = [FaultyEngine(), FaultyEngine(fault, at=at)]
    ranks, results = _run(monkeypatch, faults, k, steps)
    for rank, out in enumerate(results):
        assert not isinstance(out, BaseException), out
        assert [_rows(r) for r, _ in out] == [_rows(r) for r, _ in expected[0]], f"rank {rank}"  # none lost, none twice
        stats = [r.stats for r, _ in out]
        assert stats[-1]["rollout/engine_restarts"] == 1 and stats[-1]["rollout/engines_alive"] == 2
        assert min(s["rollout/engines_alive"] for s in stats) == 1
        assert sum(s["rollout/requests_moved"] for s in stats) >= 2  # at least the failed engine's share of a batch
        assert sum("rollout/recovery_s" in metrics for _, metrics in out) == 1
    for engine in [*faults, *ranks[1].restarted]:  # every batch sampled with its own weights
        assert all(version == max(0, step - 1 - k) for step, version in engine.served), engine.served
    restarted, survivor = ranks[1].restarted, ranks[0].collector.engine.engine
    assert len(restarted) == 1 and ranks[1].collector.engine.engine is restarted[0]
    assert restarted[0].served and restarted[0].received >= 1  # it served, only after an update (None otherwise)
    assert restarted[0].version == survivor.version == max(0, steps - 1 - k)  # the current weights, as the others
