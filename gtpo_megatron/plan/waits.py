"""The longest wait for an engine leader the settings allow, and the world group's timeout over it (arithmetic).

Past a setting the leader itself stops every rank, naming its engine (``rollout.exchange.raise_leader_failures``).
"""

from __future__ import annotations

import math
from typing import Literal

from gtpo_megatron.preemption import KILL_GRACE_S

WORLD_TIMEOUT_MARGIN_S = 1800.0
"""What the world group's timeout adds to :func:`longest_wait_s` (seconds): the work between two world collectives
that no setting bounds (an update, a checkpoint save, an engine's start; the former fixed 30 minutes)."""


def grading_bound_s(num_answers: int, *, num_workers: int, timeout_s: float) -> float:
    """The longest a reward pool grades ``num_answers`` (seconds): ``ceil(n / workers)`` answers each killed late."""
    return math.ceil(num_answers / num_workers) * (timeout_s + KILL_GRACE_S)


def longest_wait_s(
    *,
    mode: Literal["sync", "async"],
    timeout_s: float,
    max_staleness: int,
    num_answers: int,
    reward_workers: int,
    reward_timeout_s: float,
    fault_tolerance: bool = False,
) -> float:
    """Seconds, from the ``rollout.*`` and ``reward.*`` values; a weight update's ``timeout_s`` is shorter.

    Sync: a round's generation and the grading of its P*G ``num_answers``; with ``fault_tolerance`` twice (a failed
    engine's prompts sampled again on another, ``rollout/fault_tolerance.py``); async: the drain of
    ``max_staleness`` batches (grading included), with ``fault_tolerance`` twice (a moved block waits for the
    survivor's batch in progress, ``rollout/async_recovery.py``).
    """
    passes = 2 if fault_tolerance else 1
    if mode == "async":
        return passes * max_staleness * timeout_s
    return passes * (timeout_s + grading_bound_s(num_answers, num_workers=reward_workers, timeout_s=reward_timeout_s))
