"""The problem record every data source produces (its own module, so that sources import it, not each other)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Problem:
    """One question with its final reference answer; ``id`` is unique within a loaded set.

    ``answer`` is the *final* reference answer (e.g. ``"72"``), ready for :mod:`gtpo_megatron.rewards`;
    ``source`` names the problem set (``gsm8k``, ``synthetic``, ...).
    """

    id: str
    question: str
    answer: str
    source: str
