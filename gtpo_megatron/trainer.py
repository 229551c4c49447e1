"""The GTPO training loop: orchestration only (the math is in ``ops`` and ``algorithm``, the model behind ``Policy``).

A step, as ``Trainer.step`` reads: rollout (rank 0 samples and scores, then broadcasts) -> old-logprob pass
(each data-parallel rank on its rows) -> advantages, entropy filter and conflict weights on the full batch
(GTPO_SPEC sections 2-4) -> train (``policy.train_step``) -> weight sync into the engine -> metrics. ``run``
adds logging and checkpoints (every ``checkpoint.every_n_steps``, after the last step and on a stop signal).

Stop signals (``preemption``): SIGUSR1 saves at the next step boundary and stops; SIGTERM aborts the step in
flight at its next safe point and saves the last completed step. The safe points, where every rank takes the same
decision: rank 0's rollout (SIGTERM interrupts it; the broadcast then carries "aborted" to every rank), before the
training update (any rank's SIGTERM aborts: the previous step is saved), before the weight sync (the update is done:
this step is saved, its sync skipped) and the step's end (any signal: this step is saved).

Ranks: global rank 0 owns the rollout engine and the reward pool (``RolloutCollector``); every rank receives the
whole step's completions, builds the same full batch and keeps its data-parallel share (``parallel.row_shard``).
Collectives per step, all through ``parallel.collectives``: one object broadcast (world), one all-gather of the
sequence entropies (dp), one global mean for <H>_ini on the first step of the ``paper`` filter (dp), one all-reduce
of the mismatch sums (dp), the policy's own, the weight gather (model-parallel group of dp replica 0) and three MAX
all-reduces of the stop flags (world: before the update, before the sync, at the end); a save adds two barriers
(world).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from gtpo_megatron import run_dir
from gtpo_megatron.algorithm import StepWeights, build_loss_spec, compute_step_weights, weight_metrics
from gtpo_megatron.config import GTPOConfig
from gtpo_megatron.logging import MetricSink, format_step_line, plot_curves
from gtpo_megatron.ops import sequence_mean_entropy
from gtpo_megatron.parallel import (
    all_gather_rows,
    any_rank,
    barrier,
    broadcast_object,
    global_mean,
    reduce_metric_sums,
    row_shard,
)
from gtpo_megatron.preemption import StepInterrupted, StopRequests
from gtpo_megatron.rollout.batch import collate_completions, mismatch_sums, rollout_metrics
from gtpo_megatron.rollout.collector import RolloutCollector, StepRollout
from gtpo_megatron.rollout.push import push_weights
from gtpo_megatron.rollout.types import TrainBatch

if TYPE_CHECKING:
    from gtpo_megatron.parallel.groups import ParallelGroups
    from gtpo_megatron.policy import Policy

logger = logging.getLogger(__name__)


class PhaseTimer:
    """Wall-clock seconds per named phase, reported as ``time/<name>_s``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str):
        """Time the ``with`` block as ``time/<name>_s``."""
        start = time.perf_counter()
        yield
        self.seconds[f"time/{name}_s"] = time.perf_counter() - start


class StepAborted(Exception):  # noqa: N818 - a decision, not an error
    """Every rank left step ``completed_step + 1`` at the same safe point; ``completed_step`` is the last whole one."""

    def __init__(self, completed_step: int) -> None:
        super().__init__(f"step {completed_step + 1} aborted")
        self.completed_step = completed_step


class Trainer:
    """Runs ``cfg.trainer.max_steps`` GTPO steps.

    Args:
        cfg: the resolved run config (validated for this world size).
        groups: this process's ``ParallelGroups``.
        policy: the trained model (``Policy``; ``MegatronPolicy`` in production).
        collector: the rank-0 ``RolloutCollector``; None on other ranks.
        pad_token_id: padding id of the batches.
        sink: the metric sink (enabled on rank 0 only).
    """

    def __init__(
        self,
        cfg: GTPOConfig,
        *,
        groups: ParallelGroups,
        policy: Policy,
        collector: RolloutCollector | None,
        pad_token_id: int,
        sink: MetricSink,
    ) -> None:
        self.cfg = cfg
        self.groups = groups
        self.policy = policy
        self.collector = collector
        self.pad_token_id = pad_token_id
        self.sink = sink
        self.loss_spec = build_loss_spec(cfg.algorithm, cfg.rollout)
        self.checkpoint_dir = run_dir.checkpoints_dir(cfg.output_dir)
        self.initial_entropy: float | None = None
        self.loader_state: dict | None = None
        self._dp_group = groups.dp if groups.dp_size > 1 else None
        self._world = dist.group.WORLD
        self.stop_requests = StopRequests(
            on_sigterm=cfg.checkpoint.save_on_sigterm, on_sigusr1=cfg.checkpoint.save_on_sigusr1
        )
        self._last_saved_step = 0
        self._offload_enabled = cfg.rollout.offload_train_state and _cuda_available()
        if cfg.rollout.offload_train_state and not self._offload_enabled:
            logger.warning(
                "rollout.offload_train_state=true has no effect without CUDA: the training state "
                "already lives in host memory"
            )

    # ------------------------------------------------------------------------------------------------ the step
    def step(self, step: int) -> dict[str, float]:
        """One GTPO step (1-based ``step``); returns its metrics (identical on every rank except timings)."""
        timer = PhaseTimer()
        with timer.phase("step"):
            with timer.phase("rollout"):
                rollout = self._rollout(step)
            if rollout is None:  # rank 0 left the rollout on SIGTERM; every rank received None
                raise StepAborted(step - 1)
            batch = collate_completions(rollout.groups, pad_token_id=self.pad_token_id)
            rows = row_shard(batch.num_sequences, rank=self.groups.dp_rank, size=self.groups.dp_size)
            local = batch.select(rows)
            with timer.phase("old_logprob"):
                old_logprobs, entropy = self._old_logprob_pass(local)
            with timer.phase("advantages"):
                local_seq_entropy = sequence_mean_entropy(entropy, local.response_mask)
                seq_entropy = all_gather_rows(local_seq_entropy, group=self._dp_group)
                self._measure_initial_entropy(local_seq_entropy, local.response_mask)
                weights = compute_step_weights(
                    batch,
                    torch.tensor(rollout.rewards),
                    seq_entropy,
                    self.cfg.algorithm,
                    initial_entropy=self.initial_entropy,
                )
                train_batch = self._train_batch(local, weights, rows, old_logprobs)
            if self._agree(self.stop_requests.abort_requested):  # safe point: the weights are still step - 1's
                raise StepAborted(step - 1)
            with timer.phase("train"):
                train_metrics = self._train(train_batch)
            aborting = self._agree(self.stop_requests.abort_requested)  # the update is done: skip only the sync
            with timer.phase("sync"):
                sync_metrics = {} if aborting else self._sync_weights()
        self.loader_state = rollout.loader_state
        metrics = self._step_metrics(rollout, batch, weights, seq_entropy, old_logprobs, local)
        metrics.update({f"train/{k}": v for k, v in train_metrics.items()})
        metrics.update({**rollout.stats, **sync_metrics, **timer.seconds})
        metrics["perf/tokens_per_s"] = float(batch.attention_mask.sum()) / metrics["time/step_s"]
        metrics["perf/response_tokens_per_s"] = float(batch.response_mask.sum()) / metrics["time/step_s"]
        return metrics

    def _rollout(self, step: int) -> StepRollout | None:
        """Rank 0 samples and scores (engine sleeps afterwards when colocated); every rank gets the result.

        None on every rank when a SIGTERM made rank 0 leave the rollout. With ``rollout.offload_train_state``
        (CUDA) every rank's gradient buffers and optimizer states leave the GPU for the duration (the previous
        ``train_step`` consumed the gradients) and are back before it returns.
        """
        rollout = None
        if self._offload_enabled:
            self.policy.offload_train_state()
        if self.collector is not None:
            rollout = self._collect(step)
            if rollout is not None and self.cfg.rollout.placement == "colocated":
                self.collector.engine.sleep()
        rollout = broadcast_object(rollout, src=0, group=self._world)
        if self._offload_enabled:
            self.policy.restore_train_state()
        return rollout

    def _collect(self, step: int) -> StepRollout | None:
        """Rank 0's rollout and reward phase, or None when a SIGTERM interrupted it.

        Under Slurm the SIGTERM also reaches the engine's and the reward pool's processes, so any failure of the
        phase after a SIGTERM counts as the interruption; without one, errors propagate.
        """
        try:
            with self.stop_requests.interruptible():
                return self.collector.collect(step)
        except (StepInterrupted, Exception) as err:
            if not self.stop_requests.abort_requested:
                raise
            logger.warning("SIGTERM during the rollout of step %d: rollout abandoned (%s)", step, type(err).__name__)
            return None

    def _old_logprob_pass(self, local: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Log pi_old at the sampling temperature and entropy at ``entropy_temperature`` (section 4), ``[b, S]``."""
        temperature = self.cfg.rollout.temperature
        old_logprobs, entropy = self.policy.compute_logprobs(local, temperature=temperature)
        if self.cfg.algorithm.entropy_temperature != temperature:
            _, entropy = self.policy.compute_logprobs(local, temperature=self.cfg.algorithm.entropy_temperature)
        return old_logprobs, entropy

    def _measure_initial_entropy(self, local_seq_entropy: torch.Tensor, response_mask: torch.Tensor) -> None:
        """<H>_ini of the ``paper`` filter: the first step's mean <H>_i over completions with a response token."""
        if self.cfg.algorithm.entropy_filter == "paper" and self.initial_entropy is None:
            self.initial_entropy = float(
                global_mean(local_seq_entropy, group=self._dp_group, mask=response_mask.any(dim=-1))
            )

    def _train_batch(
        self, local: TrainBatch, weights: StepWeights, rows: slice, old_logprobs: torch.Tensor
    ) -> TrainBatch:
        local.advantages = weights.advantages[rows]
        local.token_weights = weights.token_weights[rows]
        local.loss_row_mask = weights.loss_row_mask[rows]
        # One update per batch: r = exp(logp - stopgrad(logp)) = 1 with gradient (GTPO_SPEC section 1).
        local.old_logprobs = old_logprobs if self.cfg.algorithm.num_updates_per_batch > 1 else None
        return local

    def _train(self, batch: TrainBatch) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for _ in range(self.cfg.algorithm.num_updates_per_batch):
            metrics = self.policy.train_step(batch, self.loss_spec)
        return metrics

    def _sync_weights(self) -> dict[str, float]:
        """Stream the new weights into the engine (rank 0); the other ranks of replica 0 drive the gather."""
        if self.collector is not None:
            self.collector.engine.wake_up()
            bucket_bytes = self.cfg.rollout.weight_sync_bucket_mb * 2**20
            return push_weights(
                self.collector.engine, self.policy.iter_hf_weights(), bucket_bytes=bucket_bytes
            ).as_metrics()
        if self.groups.dp_rank == 0:
            for _ in self.policy.iter_hf_weights():
                pass
        return {}

    def _step_metrics(
        self,
        rollout: StepRollout,
        batch: TrainBatch,
        weights: StepWeights,
        seq_entropy: torch.Tensor,
        old_logprobs: torch.Tensor,
        local: TrainBatch,
    ) -> dict[str, float]:
        """Rollout, GTPO-weight, entropy and train/rollout mismatch metrics of the step (mismatch reduced over dp)."""
        metrics = rollout_metrics(
            batch, torch.tensor(rollout.scores), torch.tensor(rollout.correct), torch.tensor(rollout.format_ok)
        )
        metrics.update(weight_metrics(weights, batch.response_mask))
        sums = mismatch_sums(old_logprobs, local.extras["rollout_logprobs"], local.response_mask)
        sums = reduce_metric_sums(sums, group=self._dp_group)
        count = max(float(sums["count"]), 1.0)
        metrics.update(
            {
                "entropy/mean": float(seq_entropy.mean()),
                "mismatch/abs_logprob_diff": float(sums["abs_logprob_diff"]) / count,
                "mismatch/prob_ratio_err": float(sums["prob_ratio_err"]) / count,
            }
        )
        if self.initial_entropy is not None:
            metrics["entropy/initial"] = self.initial_entropy
        return metrics

    # ------------------------------------------------------------------------------------------------ the loop
    def run(self) -> None:
        """Resume if asked, run the remaining steps with logging and checkpoints, then plot the curves."""
        start = self._maybe_resume()
        self._last_saved_step = start
        with self.stop_requests.installed():
            for step in range(start + 1, self.cfg.trainer.max_steps + 1):
                try:
                    metrics = self.step(step)
                except StepAborted as aborted:
                    self._save_after_abort(aborted.completed_step)
                    break
                self.sink.log(step, metrics)
                if step % self.cfg.trainer.log_every == 0:
                    self.sink.write(format_step_line(step, metrics))
                stop = self._agree(self.stop_requests.stop_requested)
                every = self.cfg.checkpoint.every_n_steps
                if stop or step == self.cfg.trainer.max_steps or (every and step % every == 0):
                    self.save(step)
                if stop:
                    self.sink.write(
                        f"{self.stop_requests.describe()}: saved step {step} and stopped; resume with resume=true"
                    )
                    break
        if self.groups.rank == 0 and self.sink.path.exists():
            plot_curves(self.sink.path, run_dir.curves_path(self.cfg.output_dir))

    def _agree(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is True on any rank (one MAX all-reduce on the world)."""
        return any_rank(flag, group=self._world)

    def _save_after_abort(self, completed_step: int) -> None:
        """Save the last completed step after an aborted one (unless it is saved already, or there is none)."""
        what = self.stop_requests.describe()
        if completed_step == 0:
            self.sink.write(f"{what}: step 1 aborted; no step completed, nothing saved")
            return
        if completed_step != self._last_saved_step:
            self.save(completed_step)
        self.sink.write(
            f"{what}: step {completed_step + 1} aborted; step {completed_step} saved; resume with resume=true"
        )

    def save(self, step: int) -> None:
        """Checkpoint model, optimizer and trainer state under ``checkpoints/step_NNNNNN``; prune old ones."""
        state = {"step": step, "initial_entropy": self.initial_entropy, "loader": self.loader_state}
        self.policy.save_checkpoint(str(run_dir.checkpoint_dir(self.cfg.output_dir, step)), state)
        self._last_saved_step = step
        barrier(group=self._world)
        if self.groups.rank == 0:
            for old in run_dir.list_checkpoints(self.checkpoint_dir)[: -self.cfg.checkpoint.keep_last]:
                run_dir.remove_checkpoint(old)
        barrier(group=self._world)

    def _maybe_resume(self) -> int:
        """Load the newest complete checkpoint when ``resume=true``; returns the number of completed steps.

        Incomplete step folders are skipped with a warning (``run_dir.newest_checkpoint``). Either way the engine
        then gets the policy's weights when they are not the HF folder's (a resumed run, or a fresh start from
        ``model.megatron_checkpoint``, whose engine starts with dummy weights).
        """
        newest = run_dir.newest_checkpoint(self.checkpoint_dir) if self.cfg.resume else None
        if newest is None:
            if self.cfg.resume:
                logger.warning(
                    "resume=true but %s holds no complete checkpoint; starting from step 0", self.checkpoint_dir
                )
            if self.cfg.model.megatron_checkpoint is not None:
                self._sync_weights()  # the engine started with dummy weights (build.build_collector)
            return 0
        state = self.policy.load_checkpoint(str(newest))
        self.initial_entropy = state.get("initial_entropy")
        self.loader_state = state.get("loader")
        if self.collector is not None and self.loader_state is not None:
            self.collector.loader.load_state_dict(self.loader_state)
        self._sync_weights()
        logger.info("resumed from %s (step %d)", newest, state["step"])
        return int(state["step"])

    def close(self) -> None:
        """Close the engine, the reward pool and the sink (rank 0); idempotent."""
        if self.collector is not None:
            self.collector.engine.close()
            self.collector.reward_pool.close()
        self.sink.close()


def _cuda_available() -> bool:
    """Whether this process trains on CUDA (a function so that CPU tests can pretend)."""
    return torch.cuda.is_available()
