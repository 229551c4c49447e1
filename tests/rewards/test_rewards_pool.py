"""RewardPool: same scores as in-process calls; grader timeouts (math-verify's included) and errors are counted,
never scored quietly; the run-stopping check; maj@k answer equivalence in the workers."""

from __future__ import annotations

import os
import signal
import time

import pytest

from gtpo_megatron.rewards import RewardPool, RewardResult, check_grader_failures, get_reward

COMPLETIONS = [
    "<reasoning>7 + 5</reasoning><answer>12</answer>",
    "<reasoning>r</reasoning><answer>\\frac{\\sqrt{2}}{2}</answer>",
    "The answer is \\boxed{1,234}",
    "<answer>13</answer>",
    "nothing here",
]
REFERENCES = ["12", "\\sqrt{2}/2", "1234", "12", "7"]
ZERO = RewardResult(0.0, False, False, None)
OK = RewardResult(1.0, True, False, "r")


def misbehaving_reward(*, completion: str, reference: str, extraction: str) -> RewardResult:
    """Test reward: sleeps on "sleep", sleeps with SIGALRM blocked (stuck in C) on "stuck", raises on "raise",
    kills its process on "die", else scores 1."""
    if completion == "sleep":
        time.sleep(60)
    if completion == "stuck":
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(60)
    if completion == "raise":
        raise ZeroDivisionError("boom")
    if completion == "die":
        os._exit(3)
    return RewardResult(score=1.0, correct=True, format_ok=False, extracted=reference)


@pytest.fixture(scope="module")
def math_pool():
    with RewardPool("math_verify", num_workers=2, timeout_s=1.0) as pool:
        yield pool


def test_pool_matches_in_process_scores_and_is_reusable() -> None:
    expected = [
        get_reward("paper")(completion=c, reference=r, extraction="strict") for c, r in zip(COMPLETIONS, REFERENCES)
    ]
    assert [r.score for r in expected] == [20.0, 20.0, 0.0, 1.0, 0.0]
    with RewardPool("paper", num_workers=2, timeout_s=10.0) as pool:
        for _ in range(2):
            results, stats = pool.score(COMPLETIONS * 3, REFERENCES * 3, extraction="strict")
            assert results == expected * 3
            assert (stats["reward"], stats["num_scored"], stats["num_timeouts"], stats["num_errors"]) == (
                "paper",
                15,
                0,
                0,
            )
        lenient, _ = pool.score(["so 12", "so 12"], ["12", "13"], extraction="lenient")
        assert [r.correct for r in lenient] == [True, False]
        assert pool.score([], []) == (
            [],
            {
                "reward": "paper",
                "num_scored": 0,
                "num_timeouts": 0,
                "num_errors": 0,
                "errors": [],
                "failed_indices": [],
                "seconds": pytest.approx(0.0, abs=1.0),
            },
        )


def test_math_verify_timeouts_are_counted_not_scored_quietly(math_pool) -> None:
    """A power tower: math-verify alone times out inside and answers False; here it is a counted timeout."""
    start = time.monotonic()
    results, stats = math_pool.score(
        ["\\boxed{9^{9^{9^{9}}}}", "\\boxed{1}", "The final answer is $9^{9^{9^{9}}}$."], ["1", "1", "1"]
    )
    assert time.monotonic() - start < 10.0
    assert results == [ZERO, RewardResult(1.0, True, False, "1"), ZERO]
    assert (stats["num_timeouts"], stats["num_errors"], stats["failed_indices"]) == (2, 0, [0, 2])
    assert stats["errors"][0] == (
        "answer 0 (timeout: no verdict within timeout_s=1.0), ending '\\\\boxed{9^{9^{9^{9}}}}'"
    )
    with pytest.raises(
        RuntimeError,
        match=r"reward 'math_verify' failed to grade 2 of 3 answers \(2 timeouts, 0 "
        r"errors\), more than reward.max_error_frac=0.5; e.g. answer 0 \(timeout",
    ):
        check_grader_failures(stats, max_error_frac=0.5)
    check_grader_failures(stats, max_error_frac=0.7)


def test_pool_counts_timeouts_and_crashes_and_keeps_going() -> None:
    with RewardPool(misbehaving_reward, num_workers=2, timeout_s=0.5, start_method="fork") as pool:
        start = time.monotonic()
        results, stats = pool.score(["a", "sleep", "b", "raise", "c", "die", "stuck", "d"], ["r"] * 8)
        assert time.monotonic() - start < 20.0
        assert results == [OK, ZERO, OK, ZERO, OK, ZERO, ZERO, OK]
        assert (stats["num_timeouts"], stats["num_errors"], stats["failed_indices"]) == (2, 2, [1, 3, 5, 6])
        assert stats["reward"] == "misbehaving_reward"
        messages = " | ".join(stats["errors"])
        assert "answer 1 (timeout: no verdict within timeout_s=0.5), ending 'sleep'" in messages
        assert "answer 3 (error: ZeroDivisionError: boom)" in messages
        assert "answer 5 (error: worker died (exit code 3))" in messages
        assert "answer 6 (timeout: worker killed after 2.5 s), ending 'stuck'" in messages
        results, stats = pool.score(["e", "f", "g"], ["r"] * 3)  # killed workers were replaced
        assert results == [OK] * 3 and stats["num_timeouts"] == stats["num_errors"] == 0
        pool._workers[0].process.kill()  # a worker that dies between steps is replaced too
        pool._workers[0].process.join()
        assert pool.score(["h", "i"], ["r"] * 2)[0] == [OK] * 2


@pytest.mark.parametrize(
    ("timeouts", "errors", "frac", "stops"),
    [
        (2, 0, 0.5, False),
        (2, 1, 0.5, True),
        (0, 3, 0.5, True),
        (4, 0, 1.0, False),
        (1, 0, 0.25, False),
        (1, 1, 0.25, True),
    ],
)
def test_check_grader_failures_threshold(timeouts: int, errors: int, frac: float, stops: bool, caplog) -> None:
    stats = {
        "reward": "paper",
        "num_scored": 4,
        "num_timeouts": timeouts,
        "num_errors": errors,
        "errors": ["answer 2 (error: ValueError: x), ending '\\\\boxed{?}'"],
    }
    if stops:
        with pytest.raises(RuntimeError, match=r"reward 'paper' failed to grade .* of 4 answers.*e\.g\. answer 2"):
            check_grader_failures(stats, max_error_frac=frac)
    else:  # under the limit: said once, with the counts and the first message
        check_grader_failures(stats, max_error_frac=frac)
        (record,) = caplog.records
        assert record.levelname == "WARNING" and record.getMessage() == (
            f"reward 'paper' did not grade {timeouts + errors} of 4 answers ({timeouts} timeouts, {errors} errors), "
            "e.g. answer 2 (error: ValueError: x), ending '\\\\boxed{?}'"
        )


def test_check_grader_failures_is_silent_without_failures(caplog) -> None:
    stats = {"reward": "paper", "num_scored": 4, "num_timeouts": 0, "num_errors": 0, "errors": []}
    check_grader_failures(stats, max_error_frac=0.5)
    assert caplog.records == []


@pytest.mark.parametrize("frac", [0.0, -0.1, 1.5])
def test_check_grader_failures_rejects_bad_fraction(frac: float) -> None:
    stats = {"reward": "paper", "num_scored": 4, "num_timeouts": 0, "num_errors": 0, "errors": []}
    with pytest.raises(ValueError, match=f"reward.max_error_frac={frac} must be in"):
        check_grader_failures(stats, max_error_frac=frac)


def test_same_answers_in_workers(math_pool) -> None:
    pairs = [("\\frac{\\sqrt{3}}{3}", "\\sqrt{3}/3"), ("2", "7"), ("1,234", "1234"), ("9^{9^{9^{9}}}", "1")]
    verdicts, stats = math_pool.same_answers(pairs)
    assert verdicts == [True, False, True, False]
    assert (stats["num_timeouts"], stats["failed_indices"]) == (1, [3])


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
    with pytest.raises(ValueError, match="extraction='loose'"):
        pool.score(["a"], ["1"], extraction="loose")
    pool.close()
    pool.close()
    with pytest.raises(RuntimeError, match="after close"):
        pool.score(["a"], ["1"])


def _ignored_signals(pid: int) -> int:
    """The ``SigIgn`` mask of process ``pid`` (bit n - 1 set: signal n ignored)."""
    status = dict(line.split(":\t", 1) for line in open(f"/proc/{pid}/status").read().splitlines() if ":\t" in line)
    return int(status["SigIgn"], 16)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc (Linux)")
def test_workers_ignore_ctrl_c_and_keep_scoring(math_pool) -> None:
    """Ctrl-C reaches the whole process group; the trainer stops its pool, so a worker ignores SIGINT (only)."""
    pids = [worker.process.pid for worker in math_pool._workers]
    masks = [_ignored_signals(pid) for pid in pids]
    assert all(mask >> (signal.SIGINT - 1) & 1 and not mask >> (signal.SIGTERM - 1) & 1 for mask in masks)
    for pid in pids:
        os.kill(pid, signal.SIGINT)
    results, stats = math_pool.score(["\\boxed{1}", "\\boxed{2}"], ["1", "2"])
    assert [r.correct for r in results] == [True, True] and stats["num_errors"] == 0
    assert [worker.process.pid for worker in math_pool._workers] == pids
