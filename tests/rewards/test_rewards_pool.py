"""RewardPool: same scores as in-process calls, timeouts and crashes score 0 and are counted, pool is reusable."""

from __future__ import annotations

import os
import time

import pytest

from gtpo_megatron.rewards import RewardPool, RewardResult, get_reward

COMPLETIONS = [
    "<reasoning>7 + 5</reasoning><answer>12</answer>",
    "<reasoning>r</reasoning><answer>\\frac{\\sqrt{2}}{2}</answer>",
    "The answer is \\boxed{1,234}",
    "<answer>13</answer>",
    "nothing here",
]
REFERENCES = ["12", "\\sqrt{2}/2", "1234", "12", "7"]


def misbehaving_reward(*, completion: str, reference: str) -> RewardResult:
    """Test reward: sleeps on "sleep", raises on "raise", kills its process on "die", else scores 1."""
    if completion == "sleep":
        time.sleep(60)
    if completion == "raise":
        raise ZeroDivisionError("boom")
    if completion == "die":
        os._exit(3)
    return RewardResult(score=1.0, correct=True, format_ok=False, extracted=reference)


def test_pool_matches_in_process_scores_and_is_reusable() -> None:
    expected = [get_reward("paper")(completion=c, reference=r) for c, r in zip(COMPLETIONS, REFERENCES)]
    assert [r.score for r in expected] == [20.0, 20.0, 0.0, 1.0, 0.0]
    with RewardPool("paper", num_workers=2, timeout_s=10.0) as pool:
        for _ in range(2):
            results, stats = pool.score(COMPLETIONS * 3, REFERENCES * 3)
            assert results == expected * 3
            assert (stats["num_scored"], stats["num_timeouts"], stats["num_errors"]) == (15, 0, 0)
        assert pool.score([], []) == ([], {"num_scored": 0, "num_timeouts": 0, "num_errors": 0, "errors": [],
                                           "failed_indices": [], "seconds": pytest.approx(0.0, abs=1.0)})


def test_pool_scores_timeouts_and_crashes_as_zero_and_keeps_going() -> None:
    zero = RewardResult(0.0, False, False, None)
    ok = RewardResult(1.0, True, False, "r")
    with RewardPool(misbehaving_reward, num_workers=2, timeout_s=1.0, start_method="fork") as pool:
        start = time.monotonic()
        results, stats = pool.score(["a", "sleep", "b", "raise", "c", "die", "d"], ["r"] * 7)
        assert time.monotonic() - start < 20.0
        assert results == [ok, zero, ok, zero, ok, zero, ok]
        assert (stats["num_timeouts"], stats["num_errors"], stats["failed_indices"]) == (1, 2, [1, 3, 5])
        assert any("ZeroDivisionError: boom" in e for e in stats["errors"])
        assert any("worker died (exit code 3)" in e for e in stats["errors"])
        results, stats = pool.score(["e", "f", "g"], ["r"] * 3)  # killed workers were replaced
        assert results == [ok] * 3 and stats["num_timeouts"] == stats["num_errors"] == 0
        pool._workers[0].process.kill()  # a worker that dies between steps is replaced too
        pool._workers[0].process.join()
        assert pool.score(["h", "i"], ["r"] * 2)[0] == [ok] * 2


def test_pool_argument_errors_and_close() -> None:
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        RewardPool("nope")
    with pytest.raises(ValueError, match="num_workers=0"):
        RewardPool("paper", num_workers=0)
    with pytest.raises(ValueError, match="timeout_s=0"):
        RewardPool("paper", timeout_s=0)
    pool = RewardPool("format", num_workers=1, timeout_s=5.0)
    with pytest.raises(ValueError, match="len\\(completions\\)=2 != len\\(references\\)=1"):
        pool.score(["a", "b"], ["1"])
    pool.close()
    pool.close()
    with pytest.raises(RuntimeError, match="after close"):
        pool.score(["a"], ["1"])
