"""The problem record every data source produces (its own module, so that sources import it, not each other)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Problem:
    """One question and its final reference answer (e.g. ``"72"``); ``id`` is unique within a loaded set."""

    id: str
    question: str
    answer: str
    source: str
