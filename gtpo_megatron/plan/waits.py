"""How long a rank may wait for an engine leader, from the settings that bound each wait (torch-free arithmetic).

A rank that does not lead an engine waits in a world collective while the leaders generate and grade a round
(sync), drain up to ``rollout.max_staleness`` batches (async) or update their engines' weights; a setting bounds
each. The world group's timeout (``GTPOConfig.world_timeout_s``) is the longest of them plus
:data:`WORLD_TIMEOUT_MARGIN_S`, so it never ends a wait the settings allow; past a setting, the leader itself stops
every rank with an error naming its engine (``rollout.exchange.raise_leader_failures``).
"""

from __future__ import annotations

import math
from typing import Literal

KILL_GRACE_S = 2.0
"""Seconds a reward worker gets past ``reward.timeout_s`` before it is killed (``rewards.pool``)."""

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
) -> float:
    """The longest wait for the engine leaders the settings allow (seconds); the ``rollout.*`` and ``reward.*`` values.

    Sync: one round's generation (``timeout_s``) and the grading of the step's ``num_answers`` (P*G); async: the
    drain, ``max_staleness`` batches of up to ``timeout_s`` each (grading included). A weight update's
    ``timeout_s`` is within both.
    """
    if mode == "async":
        return max_staleness * timeout_s
    return timeout_s + grading_bound_s(num_answers, num_workers=reward_workers, timeout_s=reward_timeout_s)
