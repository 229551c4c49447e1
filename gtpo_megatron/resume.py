"""Saving and resuming across ranks, beside ``run_dir`` (which names the folders and decides completeness).

Resume: every rank follows rank 0's newest complete checkpoint after checking it sees it complete too (else every
rank stops with both views). Save: the policy writes on every rank, rank 0 completes and prunes to
``checkpoint.keep_last``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from gtpo_megatron import run_dir
from gtpo_megatron.parallel.collectives import all_gather_object, barrier, broadcast_object

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch.distributed as dist

    from gtpo_megatron.config import GTPOConfig
    from gtpo_megatron.initial_entropy import InitialEntropy
    from gtpo_megatron.policy import Policy

logger = logging.getLogger(__name__)


def agreed_checkpoint(root: str | Path, *, rank: int, group: dist.ProcessGroup | None) -> Path | None:
    """The checkpoint every rank resumes from: rank 0's newest complete one under ``root`` (None: start fresh).

    Raises:
        RuntimeError: on every rank, when some rank does not see rank 0's choice as complete (naming both views).

    Collectives: one ``broadcast_object`` and one ``all_gather_object`` on ``group``.
    """
    root = Path(root)
    mine = run_dir.newest_checkpoint(root)
    chosen = broadcast_object(mine.name if rank == 0 and mine is not None else None, src=0, group=group)
    problem = None if chosen is None else run_dir.checkpoint_problem(root / chosen)
    if chosen is None and mine is not None:
        problem = "rank 0 sees no complete checkpoint"
    views = all_gather_object((rank, None if mine is None else mine.name, problem), group=group)
    refused = [f"rank {r} ({issue}; its newest complete: {own})" for r, own, issue in views if issue is not None]
    if refused:
        raise RuntimeError(
            f"resume=true: rank 0 chose {chosen or 'a fresh start'} under {root}, which "
            + "; ".join(refused)
            + " cannot follow: every rank must see the same checkpoints (a shared output_dir, synced before resuming)"
        )
    if mine is not None and mine.name != chosen:
        logger.warning("resume: rank %d's newest complete checkpoint is %s; following rank 0's %s", rank, mine, chosen)
    return None if chosen is None else root / chosen


class RunCheckpoints:
    """The run's checkpoints as the trainer drives them: the trainer state, saves (pruned) and the resume.

    The trainer state: ``step`` (completed steps), <H>_ini, the prompt loader's position and, given ``in_flight``
    (async rollouts), ``rollout_in_flight``: the steps whose batches were sampled ahead, which a resumed run samples
    again from the saved position.
    """

    def __init__(
        self, cfg: GTPOConfig, policy: Policy, loader, initial_entropy: InitialEntropy, *, rank: int, group,
        in_flight: Callable[[], list[int]] | None = None,
    ):  # fmt: skip
        self.cfg, self.policy, self.loader, self.initial_entropy = cfg, policy, loader, initial_entropy
        self.rank, self.group, self.in_flight = rank, group, in_flight
        self.root = run_dir.checkpoints_dir(cfg.output_dir)
        self.last_saved_step = 0

    def state(self, step: int) -> dict:
        """The trainer state after ``step`` completed steps."""
        state = {"step": step, **self.initial_entropy.state_dict(), "loader": self.loader.state_dict()}
        if self.in_flight is not None:
            state["rollout_in_flight"] = self.in_flight()
        return state

    def save(self, step: int, state: dict | None = None) -> None:
        """Checkpoint the policy and ``state`` (default: the current one) as ``step``; rank 0 then prunes.

        Collectives: the policy's save, and two barriers on the world.
        """
        self.policy.save_checkpoint(str(run_dir.checkpoint_dir(self.cfg.output_dir, step)), state or self.state(step))
        self.last_saved_step = step
        barrier(group=self.group)
        if self.rank == 0:
            for old in run_dir.list_checkpoints(self.root)[: -self.cfg.checkpoint.keep_last]:
                run_dir.remove_checkpoint(old)
        barrier(group=self.group)

    def save_after_abort(self, completed_step: int, state: dict | None) -> str:
        """Save ``completed_step`` with ``state`` after the next step aborted; returns what happened, for the log.

        Nothing is saved when it is saved already or is 0. Collectives: :meth:`save`'s, when it saves.
        """
        if completed_step == 0:
            return "step 1 aborted; no step completed, nothing saved"
        if completed_step != self.last_saved_step:
            self.save(completed_step, state)
        return f"step {completed_step + 1} aborted; step {completed_step} saved; resume with resume=true"

    def resume(self) -> int:
        """Load the agreed checkpoint when ``resume=true`` (:func:`agreed_checkpoint`); the completed steps (0: none).

        Raises:
            RuntimeError: the ranks disagree (:func:`agreed_checkpoint`).
            ValueError: <H>_ini cannot be restored (``InitialEntropy.load_state_dict``).
        """
        chosen = agreed_checkpoint(self.root, rank=self.rank, group=self.group) if self.cfg.resume else None
        if chosen is None:
            if self.cfg.resume:
                logger.warning("resume=true but %s holds no complete checkpoint; starting from step 0", self.root)
            return 0
        state = self.policy.load_checkpoint(str(chosen))
        self.initial_entropy.load_state_dict(state, completed_steps=int(state["step"]), path=chosen)
        if state.get("loader") is not None:
            self.loader.load_state_dict(state["loader"])
        logger.info("resumed from %s (step %d)", chosen, state["step"])
        if state.get("rollout_in_flight"):
            logger.info("sampling the in-flight batches of steps %s again", state["rollout_in_flight"])
        self.last_saved_step = int(state["step"])
        return self.last_saved_step
