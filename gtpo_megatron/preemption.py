"""Stop requests from signals: save what the run has before the job is killed (stdlib only).

- ``SIGUSR1`` (Slurm's ``--signal=B:USR1@<seconds>``): save at the next step boundary and stop.
- ``SIGTERM`` (preemption; SIGKILL ~30 s later) and ``SIGINT`` (Ctrl-C): abort the step in flight at its next wait
  or safe point and save the last completed step; a step whose update began is finished, unsynced, and saved.

SIGUSR1 is held from start-up (:func:`hold_stop_signals`). Handlers set flags; every wait of a step is a
:func:`wait_until`; the trainer decides at its safe points with one ``parallel.collectives.any_rank``.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gtpo_megatron.node_local import socket_path

if TYPE_CHECKING:
    from multiprocessing.managers import SyncManager

logger = logging.getLogger(__name__)
WAIT_SLICE_S = 0.05
"""Longest a wait blocks before it looks at the stop flags again (the main thread also runs handlers then)."""
KILL_GRACE_S = 2.0
"""Seconds a helper (a reward worker) gets past its own timeout before it is killed (``rewards.pool``)."""
ABORT_SIGNALS = (signal.SIGTERM, signal.SIGINT)
"""Signals that abort the step in flight (``checkpoint.save_on_sigterm``)."""
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
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


@contextlib.contextmanager
def stop_signals_held() -> Iterator[None]:
    """Start helpers here: SIGUSR1, which torchrun sends to each rank's process group, is blocked for them."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@dataclass(frozen=True, slots=True)
class HelperParent:
    """Where a helper process is started: the trainer's ``pid``, and whether from its ``main_thread``."""

    pid: int
    main_thread: bool


def helper_parent() -> HelperParent:
    """This process and the calling thread, for :func:`init_helper_process` (call it where the helper starts)."""
    return HelperParent(os.getpid(), threading.current_thread() is threading.main_thread())


def init_helper_process(parent: HelperParent, ignored: tuple[int, ...] = (*ABORT_SIGNALS, signal.SIGUSR1)) -> None:
    """Initialise a helper process of ``parent``: ignore the ``ignored`` signals, end with the trainer.

    A thread polls ``getppid`` (the helper ends within a second of the trainer); a helper started by the main
    thread also gets SIGKILL the moment the trainer ends (``PR_SET_PDEATHSIG``, Linux). That signal follows the
    thread that started the helper, not its process: armed from another thread (a partial-rollout batch's, an
    engine call's) it would kill the helper when that thread ends.
    """
    for sig in ignored:
        signal.signal(sig, signal.SIG_IGN)
    if sys.platform == "linux" and parent.main_thread:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    threading.Thread(target=_exit_with_parent, args=(parent.pid,), name="gtpo-parent-watch", daemon=True).start()


def start_helper_manager() -> SyncManager:
    """A forked ``multiprocessing`` manager (:func:`init_helper_process`); its proxies keep it alive."""
    import multiprocessing
    from multiprocessing.managers import SyncManager

    # its own socket folder: under a long TMPDIR, Python's default socket path would not fit AF_UNIX
    manager = SyncManager(address=socket_path("gtpo-ckpt"), ctx=multiprocessing.get_context("fork"))
    manager.start(init_helper_process, (helper_parent(),))
    return manager


def _exit_with_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:  # also when the parent died before the prctl above
        time.sleep(1.0)
    os._exit(0)


def wait_until(done: Callable[[float], bool], timeout_s: float | None, stop: StopRequests | None = None) -> bool:
    """Wait until ``done(seconds)`` (which blocks up to ``seconds``) is True; False after ``timeout_s`` (None: none).

    Arm before check: ``stop``'s abort flag is read before each ``WAIT_SLICE_S`` slice (the main thread runs the
    handlers of signals taken by other threads between slices), so no request before or during the wait is lost.

    Raises StepInterrupted when ``stop`` holds an abort request (SIGTERM/SIGINT).
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        if stop is not None and stop.abort_requested:
            raise StepInterrupted
        left = WAIT_SLICE_S if deadline is None else min(WAIT_SLICE_S, deadline - time.monotonic())
        if done(max(left, 0.0)):
            return True
        if deadline is not None and time.monotonic() >= deadline:
            return False


class StepInterrupted(BaseException):  # noqa: N818 - like KeyboardInterrupt: library code must not swallow it
    """An abort signal in :meth:`StopRequests.interruptible` or :func:`wait_until` (``BaseException``: kept)."""


class StopRequests:
    """The run's stop flags, set by signal handlers while :meth:`installed` is active.

    ``on_sigterm``: handle SIGTERM and SIGINT (``checkpoint.save_on_sigterm``), which set ``abort_requested``;
    ``on_sigusr1``: handle SIGUSR1 (``checkpoint.save_on_sigusr1``), which sets ``save_requested``.
    """

    def __init__(self, *, on_sigterm: bool, on_sigusr1: bool) -> None:
        self.abort_requested = False
        self.save_requested = False
        self._received: list[str] = []  # signal names, first arrival order
        self._signals = {**dict.fromkeys(ABORT_SIGNALS, on_sigterm), signal.SIGUSR1: on_sigusr1}
        self._interruptible = False

    @property
    def stop_requested(self) -> bool:
        """Whether the run must stop at the next step boundary (either signal)."""
        return self.abort_requested or self.save_requested

    def describe(self) -> str:
        """The signals received, for log lines: ``"SIGINT"``, ``"SIGTERM and SIGUSR1"``, ``"another rank's signal"``."""
        return " and ".join(self._received) or "another rank's signal"

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopRequests]:
        """Install the enabled handlers for the ``with`` block, then restore the previous ones (and the held mask).

        A held SIGUSR1 is delivered here. Off the main thread nothing is installed and the flags stay False.
        """
        wanted = [sig for sig, enabled in self._signals.items() if enabled]
        if threading.current_thread() is not threading.main_thread():
            wanted = []
        previous = {sig: signal.signal(sig, self._on_sigusr1 if sig == signal.SIGUSR1 else self._on_abort)
                    for sig in wanted}  # fmt: skip
        held = signal.SIGUSR1 in wanted and (signal.SIGUSR1 in signal.sigpending() or _HELD["received"])
        _HELD["received"] = False
        mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, set(wanted)) if wanted else None
        if held:
            self._on_sigusr1(signal.SIGUSR1, None)
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
        """A block (issuing no collective) that SIGTERM or SIGINT leaves at once with :class:`StepInterrupted`.

        Armed before the flag is checked: a signal between the two raises from the handler.
        """
        self._interruptible = True
        try:
            if self.abort_requested:
                raise StepInterrupted
            yield
        finally:
            self._interruptible = False

    def _note(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if name not in self._received:
            self._received.append(name)

    def _on_abort(self, signum, frame) -> None:
        self._note(signum)
        self.abort_requested = True
        if self._interruptible:
            self._interruptible = False
            raise StepInterrupted

    def _on_sigusr1(self, signum, frame) -> None:
        self._note(signum)
        self.save_requested = True
