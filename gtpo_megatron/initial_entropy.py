"""<H>_ini of the ``paper`` entropy filter (docs/algorithm.md section 4): measured, carried in checkpoints, restored.

<H>_ini is the mean over the first ``algorithm.initial_entropy_steps`` steps of each step's mean <H>_i over the
completions with a response token; until it is final the filter uses the running mean. Other filters never measure
it (``value`` stays None).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gtpo_megatron.parallel.collectives import global_mean

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from gtpo_megatron.config import AlgorithmConfig


class InitialEntropy:
    """<H>_ini so far: ``value`` (nats, None before the first measured step) over ``steps`` measured steps."""

    def __init__(self, cfg: AlgorithmConfig) -> None:
        self.cfg = cfg
        self.value: float | None = None
        self.steps = 0

    @property
    def known(self) -> bool:
        """<H>_ini is final: measured over ``algorithm.initial_entropy_steps`` steps."""
        return self.steps >= self.cfg.initial_entropy_steps

    def add_step(
        self, local_seq_entropy: torch.Tensor, has_tokens: torch.Tensor, *, group: dist.ProcessGroup | None
    ) -> None:
        """Average this step's ``[b]`` <H>_i (rows with ``has_tokens``) in while the ``paper`` filter measures it.

        Collectives: one ``global_mean`` on ``group`` (the data-parallel group) when it measures.
        """
        if self.cfg.entropy_filter != "paper" or self.known:
            return
        step_mean = float(global_mean(local_seq_entropy, group=group, mask=has_tokens))
        self.value = ((self.value or 0.0) * self.steps + step_mean) / (self.steps + 1)
        self.steps += 1

    def state_dict(self) -> dict:
        """The checkpoint's part: ``initial_entropy`` and ``initial_entropy_steps``."""
        return {"initial_entropy": self.value, "initial_entropy_steps": self.steps}

    def load_state_dict(self, state: dict, *, completed_steps: int, path: object) -> None:
        """Restore from a checkpoint's trainer state after ``completed_steps`` steps (saved in ``path``).

        Raises:
            ValueError: the ``paper`` filter, and the checkpoint measured <H>_ini over fewer steps than it completed
                and than ``algorithm.initial_entropy_steps`` (e.g. a run started with another filter): measuring now
                would read the trained policy's entropy instead of the initial one.
        """
        self.value = state.get("initial_entropy")
        legacy = 0 if self.value is None else 1  # checkpoints before the step count was saved
        self.steps = int(state.get("initial_entropy_steps", legacy))
        if self.cfg.entropy_filter == "paper" and self.steps < min(self.cfg.initial_entropy_steps, completed_steps):
            raise ValueError(
                f"resume=true with algorithm.entropy_filter=paper: checkpoint {path} (step {completed_steps}) holds "
                f"<H>_ini measured over {self.steps} of the first algorithm.initial_entropy_steps="
                f"{self.cfg.initial_entropy_steps} steps, and measuring it now would read the trained policy, not the "
                "initial one (docs/algorithm.md section 4); resume with the entropy filter the run was started with, "
                "or set algorithm.entropy_filter=fixed with algorithm.entropy_threshold=TAU, or start a fresh run "
                "(resume=false, a new output_dir)"
            )
