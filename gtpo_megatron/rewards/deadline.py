"""A wall-clock deadline for grading one answer, which math-verify cannot swallow (it catches its own timeouts).

:class:`GradingTimeout` is a ``BaseException``, so it passes math-verify's and SymPy's ``except Exception``. It uses
``SIGALRM``: main thread only, and work stuck in one C call is bounded by the pool's process kill instead.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


class GradingTimeout(BaseException):
    """Grading one answer took longer than its deadline."""


def _raise_timeout(signum: int, frame: object) -> None:
    raise GradingTimeout("grading took longer than its deadline")


@contextlib.contextmanager
def grading_deadline(seconds: float) -> Iterator[None]:
    """Raises :class:`GradingTimeout` in the block after ``seconds`` (> 0, else ``ValueError``); main thread only."""
    if seconds <= 0:
        raise ValueError(f"grading deadline seconds={seconds} must be > 0")
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGALRM, _raise_timeout)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
