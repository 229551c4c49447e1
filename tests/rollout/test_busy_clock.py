"""The engine's busy clock: overlapping batches count each second once (rollout/busy_clock.py)."""

from __future__ import annotations

import pytest

from gtpo_megatron.rollout.busy_clock import BusyClock


class _Time:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_overlapping_batches_count_each_second_once() -> None:
    """Batch A runs 0..6 s, batch B 2..9 s, idle 9..10 s, C 10..12 s: busy 11 s, not 6 + 7 + 2 = 15 s."""
    time = _Time()
    clock = BusyClock(time)
    for at, event in [(0, "enter"), (2, "enter"), (6, "leave"), (9, "leave"), (10, "enter"), (12, "leave")]:
        time.now = at
        getattr(clock, event)()
    time.now = 13.0
    assert clock.read() == pytest.approx(11.0)
    assert clock.read() == 0.0


def test_read_splits_a_batch_in_progress_between_reads() -> None:
    """A batch running 1..5 s read at 3 s and 7 s: 2 s, then 2 s (no second counted twice or lost)."""
    time = _Time()
    clock = BusyClock(time)
    time.now = 1.0
    clock.enter()
    time.now = 3.0
    assert clock.read() == pytest.approx(2.0)
    time.now = 5.0
    clock.leave()
    time.now = 7.0
    assert clock.read() == pytest.approx(2.0)
