"""Grades answers in worker processes with a per-answer time bound (math-verify can hang or give up on odd inputs).

Usage (one pool for the whole run)::

    with RewardPool("paper", num_workers=2, timeout_s=5.0) as pool:
        results, stats = pool.score(completions, references, extraction="strict")
        check_grader_failures(stats, max_error_frac=0.5)   # the run stops if the grader fails too often

Each worker (``spawn``: safe next to torch/vLLM threads) imports the reward once and grades one answer at a time
under :func:`~gtpo_megatron.rewards.deadline.grading_deadline`; a worker stuck in C code past ``timeout_s +
KILL_GRACE_S`` is killed and replaced. Timeouts and errors (a raise, a dead worker) are counted, never scored
quietly: a failed answer scores 0 (``same_answers``: not the same).
"""

from __future__ import annotations

import functools
import logging
import multiprocessing as mp
import signal
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

from gtpo_megatron.preemption import (
    KILL_GRACE_S,
    WAIT_SLICE_S,
    HelperParent,
    helper_parent,
    init_helper_process,
    stop_signals_held,
    wait_until,
)
from gtpo_megatron.rewards.answer_text import STRICT, check_extraction
from gtpo_megatron.rewards.deadline import GradingTimeout, grading_deadline
from gtpo_megatron.rewards.registry import RewardFn, RewardResult, decimal_tolerance, get_reward

_STARTUP_TIMEOUT_S = 120.0
_MAX_MESSAGES = 5
_FAILED = RewardResult(score=0.0, correct=False, format_ok=False, extracted=None)
logger = logging.getLogger(__name__)


def _worker_main(conn: Connection, reward: str | RewardFn, timeout_s: float, parent: HelperParent) -> None:
    """Worker loop: resolve the reward, warm math-verify, say ready, then answer ``(index, job, kwargs)`` messages.

    Ignores SIGINT and SIGUSR1 (they reach the rank's process group: the trainer acts on them); ends with the trainer.
    """
    init_helper_process(parent, ignored=(signal.SIGINT, signal.SIGUSR1))
    from gtpo_megatron.rewards.math_answer import same_answer  # math-verify: imported by the workers only

    jobs = {
        "score": get_reward(reward) if isinstance(reward, str) else reward,
        "same": functools.partial(same_answer, decimal_abs_tol=decimal_tolerance(reward)),
    }
    same_answer("\\frac{1}{2}", "0.5")  # math-verify's first call builds its parsers: ~35x a warm call, not timed
    conn.send("ready")
    while True:
        task = conn.recv()
        if task is None:
            return
        index, job, kwargs = task
        try:
            with grading_deadline(timeout_s):
                value = jobs[job](**kwargs)
        except GradingTimeout:
            conn.send((index, None, ("timeout", f"no verdict within timeout_s={timeout_s}")))
        except Exception as exc:  # noqa: BLE001 - any grader failure is counted and reported
            conn.send((index, None, ("error", f"{type(exc).__name__}: {str(exc)[:200]}")))
        else:
            conn.send((index, value, None))


def _reward_label(reward: str | RewardFn) -> str:
    """The reward's name for messages: the registry name, else the function's name."""
    return reward if isinstance(reward, str) else getattr(reward, "__name__", repr(reward))


def check_error_frac(max_error_frac: float, *, field: str = "reward.max_error_frac") -> float:
    """Returns ``max_error_frac`` when it is a fraction in (0, 1]; else ``ValueError`` naming ``field``."""
    if not 0 < max_error_frac <= 1:
        raise ValueError(f"{field}={max_error_frac} must be in (0, 1]; the default is 0.5")
    return max_error_frac


def check_grader_failures(
    stats: Mapping[str, Any],
    *,
    max_error_frac: float = 0.5,
    where: str = "",
    fields: tuple[str, str] = ("reward.max_error_frac", "reward.timeout_s"),
) -> None:
    """Stops a run whose grader failed on more than ``max_error_frac`` of one :meth:`RewardPool.score` call.

    Fewer failures are logged (a warning with the counts and the first message; ``reward/num_*`` counts them).
    ``where`` prefixes the message (the benchmark); ``fields`` name the error fraction and timeout settings.

    Raises:
        ValueError: ``max_error_frac`` outside (0, 1].
        RuntimeError: naming the reward, the counts and an example answer.
    """
    frac_field, timeout_field = fields
    check_error_frac(max_error_frac, field=frac_field)
    failed = stats["num_timeouts"] + stats["num_errors"]
    example = stats["errors"][0] if stats["errors"] else "no message"
    if 0 < failed <= max_error_frac * stats["num_scored"]:
        logger.warning("%sreward %r did not grade %d of %d answers (%d timeouts, %d errors), e.g. %s", where,
                       stats["reward"], failed, stats["num_scored"], stats["num_timeouts"], stats["num_errors"],
                       example)  # fmt: skip
    if failed > max_error_frac * stats["num_scored"]:
        raise RuntimeError(
            f"{where}reward {stats['reward']!r} failed to grade {failed} of {stats['num_scored']} answers "
            f"({stats['num_timeouts']} timeouts, {stats['num_errors']} errors), more than "
            f"{frac_field}={max_error_frac}; e.g. {example}. Check the reward on that answer in one "
            f"process, raise {timeout_field} if answers are merely slow, or raise {frac_field}"
        )


class _Worker:
    """One worker process and the parent's end of its pipe."""

    def __init__(self, ctx: Any, reward: str | RewardFn, timeout_s: float) -> None:
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(
            target=_worker_main, args=(child_conn, reward, timeout_s, helper_parent()), daemon=True
        )
        with stop_signals_held():
            self.process.start()
        child_conn.close()

    def wait_ready(self) -> None:
        """Blocks until the worker has imported its reward; ``RuntimeError`` if it dies or is silent too long."""
        try:
            ready = wait_until(self.conn.poll, _STARTUP_TIMEOUT_S) and self.conn.recv() == "ready"
        except EOFError:
            ready = False
        if not ready:
            self.kill()
            raise RuntimeError(
                f"reward worker failed to start (exit code {self.process.exitcode}); run the reward once in the "
                "main process to see the import error"
            )

    def kill(self, grace_s: float = 0.0) -> None:
        """Reaps the process, killing it if still running after ``grace_s`` seconds (only this pool's child)."""
        self.process.join(timeout=grace_s)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()


class RewardPool:
    """A reusable pool of ``num_workers`` reward workers, ``timeout_s`` wall-clock seconds per answer.

    ``reward_name`` is a registered reward or a picklable module-level function (``spawn`` needs it importable).

    Raises:
        ValueError: an unknown reward name, ``num_workers < 1`` or ``timeout_s <= 0``.
        RuntimeError: a worker cannot start.
    """

    def __init__(
        self, reward_name: str | RewardFn, num_workers: int = 2, timeout_s: float = 5.0, start_method: str = "spawn"
    ) -> None:
        if isinstance(reward_name, str):
            get_reward(reward_name)
        if num_workers < 1:
            raise ValueError(f"num_workers={num_workers} must be >= 1; use 1 for a single worker process")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0 seconds; the default is 5.0")
        self._reward = reward_name
        self._timeout_s = timeout_s
        self._ctx = mp.get_context(start_method)
        self._workers: list[_Worker | None] = [None] * num_workers
        self._closed = False
        for slot in range(num_workers):
            self._ensure_worker(slot)

    def _ensure_worker(self, slot: int) -> _Worker:
        """The live worker in ``slot``, starting (and waiting for) a fresh one when it is empty or has died."""
        worker = self._workers[slot]
        if worker is not None and not worker.process.is_alive():
            self._retire(slot)
            worker = None
        if worker is None:
            worker = _Worker(self._ctx, self._reward, self._timeout_s)
            worker.wait_ready()
            self._workers[slot] = worker
        return worker

    def _retire(self, slot: int, grace_s: float = 0.0) -> int | None:
        """Kills the worker in ``slot`` and returns its exit code; a replacement starts when the slot is needed."""
        worker = self._workers[slot]
        self._workers[slot] = None
        if worker is None:
            return None
        worker.kill(grace_s)
        return worker.process.exitcode

    def score(
        self, completions: Sequence[str], references: Sequence[str], *, extraction: str = STRICT
    ) -> tuple[list[RewardResult], dict[str, Any]]:
        """Scores ``completions[i]`` against ``references[i]`` in ``extraction`` mode; returns ``(results, stats)``.

        ``stats``: ``reward``, ``num_scored``, ``num_timeouts``, ``num_errors``, ``errors`` (up to 5 messages naming
        the answer, the failure and the answer's end), ``failed_indices`` (sorted), ``seconds``.

        Raises:
            ValueError: the lists differ in length, or an unknown ``extraction``.
            RuntimeError: the pool is closed or a replacement worker cannot start.
        """
        if len(completions) != len(references):
            raise ValueError(f"len(completions)={len(completions)} != len(references)={len(references)}")
        check_extraction(extraction)
        tasks = [
            ("score", {"completion": c, "reference": r, "extraction": extraction})
            for c, r in zip(completions, references, strict=True)
        ]
        values, stats = self._run(tasks, lambda i: completions[i][-120:])
        return [_FAILED if v is None else v for v in values], stats

    def same_answers(self, pairs: Sequence[tuple[str, str]]) -> tuple[list[bool], dict[str, Any]]:
        """``(verdicts, stats)``: whether each pair of extracted answers is the same answer (a failed pair: not).

        Raises:
            RuntimeError: the pool is closed or a replacement worker cannot start.
        """
        tasks = [("same", {"first": a, "second": b}) for a, b in pairs]
        values, stats = self._run(tasks, lambda i: f"{pairs[i][0][-60:]} vs {pairs[i][1][-60:]}")
        return [bool(v) for v in values], stats

    def _run(self, tasks: list[tuple[str, dict]], describe: Callable[[int], str]) -> tuple[list, dict[str, Any]]:
        """Runs every task on the workers; ``None`` for a failed one. ``describe(i)`` quotes task i in messages."""
        if self._closed:
            raise RuntimeError("RewardPool used after close(); build a new pool")
        start = time.monotonic()
        values: list = [None] * len(tasks)
        stats: dict[str, Any] = {
            "reward": _reward_label(self._reward),
            "num_scored": len(tasks),
            "num_timeouts": 0,
            "num_errors": 0,
            "errors": [],
            "failed_indices": [],
        }
        pending = deque(range(len(tasks)))
        busy: dict[int, tuple[int, float]] = {}  # slot -> (task index, hard deadline)
        while pending or busy:
            for slot in range(len(self._workers)):
                if pending and slot not in busy:
                    index = pending.popleft()
                    self._ensure_worker(slot).conn.send((index, *tasks[index]))
                    busy[slot] = (index, time.monotonic() + self._timeout_s + KILL_GRACE_S)
            for index, value, failure in self._collect(busy):
                if failure is None:
                    values[index] = value
                else:
                    _count_failure(stats, index, failure, describe(index))
        stats["failed_indices"].sort()
        stats["seconds"] = time.monotonic() - start
        return values, stats

    def _collect(self, busy: dict[int, tuple[int, float]]) -> list[tuple[int, Any, tuple[str, str] | None]]:
        """Waits until the next reply or hard deadline; returns ``(index, value, failure)`` of finished tasks."""
        next_deadline = min(deadline for _, deadline in busy.values())
        conns = {self._workers[slot].conn: slot for slot in busy}  # type: ignore[union-attr]
        finished = []
        timeout_s = min(WAIT_SLICE_S, max(0.0, next_deadline - time.monotonic()))  # handlers run between slices
        for conn in wait(list(conns), timeout=timeout_s):
            slot = conns[conn]
            index, _ = busy.pop(slot)
            try:
                _, value, failure = conn.recv()
            except (EOFError, OSError):
                value, failure = None, ("error", f"worker died (exit code {self._retire(slot, grace_s=1.0)})")
            finished.append((index, value, failure))
        now = time.monotonic()
        for slot, (index, deadline) in list(busy.items()):
            if now >= deadline:
                busy.pop(slot)
                self._retire(slot)
                killed_after = self._timeout_s + KILL_GRACE_S
                finished.append((index, None, ("timeout", f"worker killed after {killed_after:.1f} s")))
        return finished

    def close(self) -> None:
        """Stops every worker (politely, then by kill); idempotent."""
        if self._closed:
            return
        self._closed = True
        for slot, worker in enumerate(self._workers):
            if worker is not None:
                try:
                    worker.conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
                self._retire(slot, grace_s=2.0)

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _count_failure(stats: dict[str, Any], index: int, failure: tuple[str, str], quote: str) -> None:
    """Adds one failed task to ``stats`` (counts, index, and a message while fewer than five are kept)."""
    kind, detail = failure
    stats["num_timeouts" if kind == "timeout" else "num_errors"] += 1
    stats["failed_indices"].append(index)
    if len(stats["errors"]) < _MAX_MESSAGES:
        stats["errors"].append(f"answer {index} ({kind}: {detail}), ending {quote!r}")
