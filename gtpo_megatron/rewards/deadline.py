"""A wall-clock deadline for grading one answer, which math-verify cannot swallow.

math-verify's own timeouts raise its ``TimeoutException`` and then catch it, returning ``False``/``[]`` as if the
answer were simply wrong. :func:`grading_deadline` instead raises :class:`GradingTimeout`, a ``BaseException``
that passes through math-verify's and SymPy's ``except Exception`` handlers, so a timed-out answer is reported as
a timeout (``reward/num_timeouts``) rather than scored as a quiet 0.

It uses ``SIGALRM`` (``setitimer``, sub-second), so it only works in a process's main thread; elsewhere it does
nothing and the reward pool's process kill is the only bound. Work stuck inside one C call (a huge integer power)
is not interrupted until the call returns: the pool kills such a worker after its hard timeout.
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
    """Raises :class:`GradingTimeout` inside the block once ``seconds`` (> 0) of wall time have passed.

    A no-op outside the main thread. On exit the timer is cleared and the previous ``SIGALRM`` handler restored.

    Raises:
        ValueError: ``seconds <= 0``.
    """
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
