"""Scores completions in worker processes with a per-answer timeout (math-verify can hang on odd inputs).

Usage (the pool is meant to live for the whole run and be reused at every step)::

    with RewardPool("paper", num_workers=2, timeout_s=5.0) as pool:
        results, stats = pool.score(completions, references)

Each worker is a ``multiprocessing`` process (``spawn`` by default: safe next to torch/vLLM threads) that imports
the reward module once and then scores one answer at a time, so the parent always knows which answer a worker is
busy with. An answer that takes longer than ``timeout_s`` gets its worker killed (SIGKILL on the process this pool
started) and replaced; an exception in the reward function, or a worker that dies (segfault, ``os._exit``), is
an error. Timed-out and errored answers score 0 (``RewardResult(0.0, False, False, None)``) and are counted in
``stats``; the run never stops because of one answer. The worker runs rewards in its main thread, so
math-verify's own signal-based timeouts stay active there as a first line of defence.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections import deque
from multiprocessing.connection import Connection, wait
from typing import Any

from gtpo_megatron.rewards.registry import RewardFn, RewardResult, get_reward

_STARTUP_TIMEOUT_S = 120.0
_FAILED = RewardResult(score=0.0, correct=False, format_ok=False, extracted=None)


def _worker_main(conn: Connection, reward: str | RewardFn) -> None:
    """Worker loop: resolve the reward once, say ready, then answer ``(index, completion, reference)`` messages."""
    reward_fn = get_reward(reward) if isinstance(reward, str) else reward
    conn.send("ready")
    while True:
        task = conn.recv()
        if task is None:
            return
        index, completion, reference = task
        try:
            conn.send((index, reward_fn(completion=completion, reference=reference), None))
        except Exception as exc:  # noqa: BLE001 - any reward failure is scored 0 and reported
            conn.send((index, None, f"{type(exc).__name__}: {exc}"))


class _Worker:
    """One worker process and the parent's end of its pipe."""

    def __init__(self, ctx: Any, reward: str | RewardFn) -> None:
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child_conn, reward), daemon=True)
        self.process.start()
        child_conn.close()

    def wait_ready(self) -> None:
        """Blocks until the worker has imported its reward.

        Raises:
            RuntimeError: if the worker dies or is silent for ``_STARTUP_TIMEOUT_S`` seconds.
        """
        try:
            ready = self.conn.poll(_STARTUP_TIMEOUT_S) and self.conn.recv() == "ready"
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
    """A reusable pool of reward workers.

    Args:
        reward_name: a registered reward name (see :mod:`gtpo_megatron.rewards.registry`) or a picklable
            module-level reward function.
        num_workers: number of worker processes (>= 1).
        timeout_s: wall-clock seconds allowed per answer (> 0), measured from dispatch to the worker.
        start_method: ``multiprocessing`` start method; ``spawn`` (default) needs importable reward functions.

    Raises:
        ValueError: on an unknown reward name, ``num_workers < 1`` or ``timeout_s <= 0``.
        RuntimeError: if a worker cannot start.
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
            worker = _Worker(self._ctx, self._reward)
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

    def score(self, completions: list[str], references: list[str]) -> tuple[list[RewardResult], dict[str, Any]]:
        """Scores ``completions[i]`` against ``references[i]`` for every ``i``.

        Returns:
            ``(results, stats)``: ``results[i]`` is the :class:`RewardResult` of answer ``i`` (a zero result on
            timeout or error). ``stats`` has ``num_scored``, ``num_timeouts``, ``num_errors`` (ints),
            ``errors`` (up to 5 messages, list of str), ``failed_indices`` (sorted indices of timed-out or
            errored answers) and ``seconds`` (float, wall time of this call).

        Raises:
            ValueError: if the two lists differ in length.
            RuntimeError: if the pool is closed or a replacement worker cannot start.
        """
        if len(completions) != len(references):
            raise ValueError(f"len(completions)={len(completions)} != len(references)={len(references)}")
        if self._closed:
            raise RuntimeError("RewardPool.score called after close(); build a new pool")
        start = time.monotonic()
        results: list[RewardResult] = [_FAILED] * len(completions)
        stats: dict[str, Any] = {"num_scored": len(completions), "num_timeouts": 0, "num_errors": 0, "errors": [],
                                 "failed_indices": []}
        pending = deque(range(len(completions)))
        busy: dict[int, tuple[int, float]] = {}  # slot -> (answer index, deadline)
        while pending or busy:
            for slot in range(len(self._workers)):
                if pending and slot not in busy:
                    index = pending.popleft()
                    self._ensure_worker(slot).conn.send((index, completions[index], references[index]))
                    busy[slot] = (index, time.monotonic() + self._timeout_s)
            self._collect(busy, results, stats)
        stats["failed_indices"].sort()
        stats["seconds"] = time.monotonic() - start
        return results, stats

    def _collect(self, busy: dict[int, tuple[int, float]], results: list[RewardResult], stats: dict) -> None:
        """Waits until the next reply or deadline, then records replies, crashes and timeouts."""
        next_deadline = min(deadline for _, deadline in busy.values())
        conns = {self._workers[slot].conn: slot for slot in busy}  # type: ignore[union-attr]
        for conn in wait(list(conns), timeout=max(0.0, next_deadline - time.monotonic())):
            slot = conns[conn]
            index, _ = busy.pop(slot)
            try:
                _, result, error = conn.recv()
            except (EOFError, OSError):
                result, error = None, f"worker died (exit code {self._retire(slot, grace_s=1.0)})"
            if error is None:
                results[index] = result
            else:
                stats["num_errors"] += 1
                stats["failed_indices"].append(index)
                if len(stats["errors"]) < 5:
                    stats["errors"].append(f"answer {index}: {error}")
        now = time.monotonic()
        for slot, (index, deadline) in list(busy.items()):
            if now >= deadline:
                busy.pop(slot)
                self._retire(slot)
                stats["num_timeouts"] += 1
                stats["failed_indices"].append(index)

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
