"""The engine's busy seconds in async mode: the union of the intervals in which any batch is sampled or scored.

Streamed batches (``rollout.partial_rollouts``) overlap, so summing each batch's seconds counts the shared seconds
twice (or more); this clock counts each second in which at least one batch is in progress once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class BusyClock:
    """Counts seconds with at least one :meth:`enter` not yet matched by :meth:`leave` (thread-safe).

    ``now``: the clock in seconds (``time.perf_counter``; a test passes its own).
    """

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self._now, self._lock = now, threading.Lock()
        self._active, self._since, self._busy_s = 0, 0.0, 0.0

    def enter(self) -> None:
        """A batch starts (the clock runs from the first of overlapping batches)."""
        with self._lock:
            if self._active == 0:
                self._since = self._now()
            self._active += 1

    def leave(self) -> None:
        """A batch ends (the clock stops with the last of overlapping batches)."""
        with self._lock:
            self._active -= 1
            if self._active == 0:
                self._busy_s += self._now() - self._since

    def read(self) -> float:
        """Busy seconds since the previous read (a batch in progress counts up to now, the rest after)."""
        with self._lock:
            busy_s, self._busy_s = self._busy_s, 0.0
            if self._active:
                now = self._now()
                busy_s, self._since = busy_s + now - self._since, now
            return busy_s
