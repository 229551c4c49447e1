"""Async mode's engine busy seconds: any batch sampled or scored, overlapping (streamed) batches counted once."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class BusyClock:
    """Seconds with an :meth:`enter` not yet matched by :meth:`leave` (thread-safe); ``now``: the clock, seconds."""

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
