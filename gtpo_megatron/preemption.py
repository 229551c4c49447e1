"""Stop requests from signals: save what the run has before the job is killed (stdlib only).

- ``SIGUSR1`` (Slurm's ``--signal=B:USR1@<seconds>``): save at the next step boundary and stop.
- ``SIGTERM`` (preemption, time limit; SIGKILL ~30 s later): abort the step in flight at the next safe point and
  save the last completed step (one whose update is done counts; only its weight sync is skipped).

SIGUSR1 is held from start-up (:func:`hold_stop_signals`): a request during start-up waits for the first step
boundary, and helper processes inherit it blocked. Handlers only set flags, except inside
:meth:`StopRequests.interruptible`, where SIGTERM raises :class:`StepInterrupted`; the trainer decides at its safe
points with one ``parallel.collectives.any_rank``.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator

logger = logging.getLogger(__name__)
_HELD = {"received": False}  # a SIGUSR1 handled while held (taken by another thread), for StopRequests.installed


def _on_held_sigusr1(signum, frame) -> None:
    _HELD["received"] = True


def hold_stop_signals() -> None:
    """Block SIGUSR1 in this thread and all it starts; call first, before any thread or helper process starts."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGUSR1, _on_held_sigusr1)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})


def release_stop_signals() -> None:
    """Undo :func:`hold_stop_signals` (``checkpoint.save_on_sigusr1=false``: SIGUSR1 gets its default action again)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})


def ignore_stop_signals() -> None:
    """Ignore SIGTERM and SIGUSR1 (the initializer of a helper process that a save needs)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


class StepInterrupted(BaseException):  # noqa: N818 - like KeyboardInterrupt: library code must not swallow it
    """Raised by SIGTERM inside :meth:`StopRequests.interruptible` (a ``BaseException``: not swallowed)."""


class StopRequests:
    """The run's stop flags, set by signal handlers while :meth:`installed` is active.

    Args:
        on_sigterm: handle SIGTERM (``checkpoint.save_on_sigterm``); otherwise it keeps its previous handler.
        on_sigusr1: handle SIGUSR1 (``checkpoint.save_on_sigusr1``).

    Attributes:
        abort_requested: a SIGTERM arrived: abort the step in flight at the next safe point.
        save_requested: a SIGUSR1 arrived: save at the next step boundary and stop.
    """

    def __init__(self, *, on_sigterm: bool, on_sigusr1: bool) -> None:
        self.abort_requested = False
        self.save_requested = False
        self._signals = {signal.SIGTERM: on_sigterm, signal.SIGUSR1: on_sigusr1}
        self._interruptible = False

    @property
    def stop_requested(self) -> bool:
        """Whether the run must stop at the next step boundary (either signal)."""
        return self.abort_requested or self.save_requested

    def describe(self) -> str:
        """The signals received, for log lines (``"SIGTERM"``, ``"SIGUSR1"``, both, or ``"a rank's signal"``)."""
        names = [name for name, flag in (("SIGTERM", self.abort_requested), ("SIGUSR1", self.save_requested)) if flag]
        return " and ".join(names) or "another rank's signal"

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopRequests]:
        """Install the enabled handlers for the ``with`` block, then restore the previous ones (and the held mask).

        A held SIGUSR1 is delivered here. Off the main thread nothing is installed and the flags stay False.
        """
        wanted = [sig for sig, enabled in self._signals.items() if enabled]
        if threading.current_thread() is not threading.main_thread():
            wanted = []
        handlers = {signal.SIGTERM: self._on_sigterm, signal.SIGUSR1: self._on_sigusr1}
        previous = {sig: signal.signal(sig, handlers[sig]) for sig in wanted}
        held = signal.SIGUSR1 in wanted and (signal.SIGUSR1 in signal.sigpending() or _HELD["received"])
        _HELD["received"] = False
        mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, set(wanted)) if wanted else None
        if held:
            self.save_requested = True
            logger.warning("SIGUSR1 received during start-up: saving at the first step boundary and stopping")
        try:
            yield self
        finally:
            if mask is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """A block (issuing no collective) that SIGTERM leaves at once with :class:`StepInterrupted`."""
        if self.abort_requested:
            raise StepInterrupted
        self._interruptible = True
        try:
            yield
        finally:
            self._interruptible = False

    def _on_sigterm(self, signum, frame) -> None:
        self.abort_requested = True
        if self._interruptible:
            self._interruptible = False
            raise StepInterrupted

    def _on_sigusr1(self, signum, frame) -> None:
        self.save_requested = True
