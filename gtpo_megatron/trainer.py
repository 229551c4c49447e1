"""The GTPO training loop: orchestration only (the math is in ``ops`` and ``algorithm``, the model behind ``Policy``).

A step, as ``Trainer.step`` reads: rollout (every engine leader samples and scores its share, then every rank
gets the whole step) -> only where unavoidable, a no-grad pass of the policy before the update
(``algorithm.needs_old_logprob_pass``: several updates per batch, the ``paper`` filter's <H>_ini still being
measured, or conflict weights that need the entropies; timed as ``time/old_logprob_s``, 0 when skipped) -> with a
KL term, the reference policy's pass (``time/ref_logprob_s``) -> advantages and conflict weights on the full batch
(GTPO_SPEC sections 2-3) -> train (``policy.train_step``; the entropy filter and penalty, section 4, are decided
inside its forward) -> weight sync into the engines -> metrics. ``run`` adds logging and checkpoints (every
``checkpoint.every_n_steps``, after the last step and on a stop signal).

Stop signals (``preemption``): SIGUSR1 saves at the next step boundary and stops; SIGTERM aborts the step in
flight at its next safe point and saves the last completed step. The safe points, where every rank takes the same
decision: the rollout (SIGTERM interrupts each engine leader's sampling; the rollout exchange then carries
"aborted" to every rank), before the training update (any rank's SIGTERM aborts: the previous step is saved),
before the weight sync (the update is done: this step is saved, its sync skipped) and the step's end (any signal:
this step is saved).

Ranks: each engine leader owns an engine and a reward pool (``RolloutCollector``; global rank 0 always leads one);
every rank receives the whole step's completions, builds the same full batch and keeps its data-parallel share
(``parallel.row_shard``). Collectives per step, all through ``parallel.collectives``: the rollout exchange (world:
one all-reduce per dynamic-sampling round and one of the packed step, ``rollout.collector.collect_step``); when the
pass before the update runs, one all-gather of the sequence entropies (dp) and, while <H>_ini is measured, one global
mean (dp); the policy's (and the reference's) own; the weight gather (model-parallel group of dp replica 0) and its
push to the engines (``rollout.push``: the weight group's broadcasts); three MAX all-reduces of the stop flags
(world: before the update, before the sync, at the end); a save adds two barriers (world).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from gtpo_megatron import run_dir
from gtpo_megatron.algorithm import (
    StepWeights,
    build_loss_spec,
    compute_step_weights,
    conflict_metrics,
    needs_old_logprob_pass,
    objective_metrics,
)
from gtpo_megatron.config import GTPOConfig
from gtpo_megatron.logging import MetricSink, format_step_line, plot_curves
from gtpo_megatron.ops import sequence_mean_entropy
from gtpo_megatron.parallel import (
    all_gather_rows,
    any_rank,
    barrier,
    global_mean,
    row_shard,
)
from gtpo_megatron.preemption import StopRequests
from gtpo_megatron.rollout.batch import collate_completions, rollout_metrics
from gtpo_megatron.rollout.collector import RolloutCollector, StepRollout, collect_step
from gtpo_megatron.rollout.engine_guard import close_all
from gtpo_megatron.rollout.push import CollectiveWeightSync, FilesWeightSync
from gtpo_megatron.rollout.types import TrainBatch

if TYPE_CHECKING:
    from gtpo_megatron.data.loader import PromptLoader
    from gtpo_megatron.ops import LossSpec
    from gtpo_megatron.parallel.groups import ParallelGroups
    from gtpo_megatron.policy import Policy, ReferencePolicy

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
        collector: this rank's ``RolloutCollector`` when it leads an engine; None on other ranks.
        loader: the prompt loader, built identically on every rank (its position goes into checkpoints).
        pad_token_id: padding id of the batches.
        sink: the metric sink (enabled on rank 0 only).
        reference: the frozen reference policy of the KL term (``algorithm.kl_coef > 0``), else None.
        num_engines: engines sharing each step (``plan.engines``).
        weight_sync: this rank's part of the weight push (``rollout.push``); default: the ``files`` path into the
            collector's engine.
    """

    def __init__(
        self,
        cfg: GTPOConfig,
        *,
        groups: ParallelGroups,
        policy: Policy,
        collector: RolloutCollector | None,
        loader: PromptLoader,
        pad_token_id: int,
        sink: MetricSink,
        reference: ReferencePolicy | None = None,
        num_engines: int = 1,
        weight_sync: CollectiveWeightSync | FilesWeightSync | None = None,
    ) -> None:
        self.cfg = cfg
        self.groups = groups
        self.policy = policy
        self.collector = collector
        self.loader = loader
        self.pad_token_id = pad_token_id
        self.sink = sink
        self.reference = reference
        if (reference is None) != (cfg.algorithm.kl_coef == 0):
            raise ValueError(
                f"algorithm.kl_coef={cfg.algorithm.kl_coef} needs a reference policy exactly when it is > 0; got "
                f"reference={reference!r} (build.build_trainer builds it)"
            )
        self.loss_spec = build_loss_spec(cfg.algorithm, cfg.rollout)
        self.checkpoint_dir = run_dir.checkpoints_dir(cfg.output_dir)
        self.initial_entropy: float | None = None
        self.initial_entropy_steps = 0  # steps averaged into initial_entropy so far
        self._measure_mismatch = self.loss_spec.temperature == cfg.rollout.temperature
        if not self._measure_mismatch:
            logger.warning(
                "algorithm.loss_temperature=%s: the loss log-probs are at T=%s while vLLM's are at the sampling "
                "temperature %s, so mismatch/* are not reported",
                cfg.algorithm.loss_temperature,
                self.loss_spec.temperature,
                cfg.rollout.temperature,
            )
        self._dp_group = groups.dp if groups.dp_size > 1 else None
        self._world = dist.group.WORLD
        self.num_engines = num_engines
        self.weight_sync = weight_sync or FilesWeightSync(
            engine=collector.engine if collector is not None else None,
            exporting=groups.dp_rank == 0,
            bucket_bytes=cfg.rollout.weight_sync_bucket_mb * 2**20,
        )
        self.stop_requests = StopRequests(
            on_sigterm=cfg.checkpoint.save_on_sigterm, on_sigusr1=cfg.checkpoint.save_on_sigusr1
        )
        self._last_saved_step = 0
        self._completed_state: dict | None = None  # the trainer state before the step in flight
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
        self._completed_state = self._trainer_state(step - 1)  # what an abort of this step saves
        with timer.phase("step"):
            with timer.phase("rollout"):
                rollout = self._rollout(step)
            if rollout is None:  # a SIGTERM made an engine leader leave the rollout; every rank received None
                raise StepAborted(step - 1)
            batch = collate_completions(rollout.groups, pad_token_id=self.pad_token_id)
            rows = row_shard(batch.num_sequences, rank=self.groups.dp_rank, size=self.groups.dp_size)
            local = batch.select(rows)
            old_logprobs, seq_entropy = None, None
            if needs_old_logprob_pass(self.cfg.algorithm, initial_entropy_known=self._initial_entropy_known()):
                with timer.phase("old_logprob"):
                    old_logprobs, seq_entropy = self._old_logprob_pass(local)
            if self.reference is not None:
                with timer.phase("ref_logprob"):
                    local.ref_logprobs = self._ref_logprob_pass(local)
            with timer.phase("advantages"):
                spec = dataclasses.replace(self.loss_spec, initial_entropy=self.initial_entropy)
                rewards, scores = torch.tensor(rollout.rewards), torch.tensor(rollout.scores)
                weights = compute_step_weights(
                    batch, rewards, self.cfg.algorithm, loss_spec=spec, seq_entropy=seq_entropy, scores=scores
                )
                train_batch = self._train_batch(local, weights, rows, old_logprobs, seq_entropy)
            if self._agree(self.stop_requests.abort_requested):  # safe point: the weights are still step - 1's
                raise StepAborted(step - 1)
            with timer.phase("train"):
                train_metrics = self._train(train_batch, spec)
            aborting = self._agree(self.stop_requests.abort_requested)  # the update is done: skip only the sync
            with timer.phase("sync"):
                sync_metrics = {} if aborting else self._sync_weights()
        return self._step_metrics(rollout, batch, weights, train_metrics, {**sync_metrics, **timer.seconds})

    def _step_metrics(
        self,
        rollout: StepRollout,
        batch: TrainBatch,
        weights: StepWeights,
        train_metrics: dict[str, float],
        measured: dict[str, float],
    ) -> dict[str, float]:
        """The step's metrics, identical on every rank except timings.

        Rollout, conflict and objective metrics, the policy's as ``train/*``, ``measured`` (the weight sync's
        ``sync/*`` and the phase times ``time/*``) and throughput.
        """
        metrics = rollout_metrics(
            batch, torch.tensor(rollout.scores), torch.tensor(rollout.correct), torch.tensor(rollout.format_ok)
        )
        metrics.update(conflict_metrics(weights, batch.response_mask))
        metrics.update(objective_metrics(train_metrics))
        if self.initial_entropy is not None:
            metrics["entropy/initial"] = self.initial_entropy
        metrics.update({f"train/{k}": v for k, v in train_metrics.items()})
        metrics.update({"time/old_logprob_s": 0.0, **({"time/ref_logprob_s": 0.0} if self.reference else {})})
        metrics.update({**rollout.stats, **measured})
        metrics["perf/tokens_per_s"] = float(batch.attention_mask.sum()) / metrics["time/step_s"]
        metrics["perf/response_tokens_per_s"] = float(batch.response_mask.sum()) / metrics["time/step_s"]
        return metrics

    def _rollout(self, step: int) -> StepRollout | None:
        """Engine leaders sample and score (engines sleep afterwards when colocated); every rank gets the result.

        None on every rank when a SIGTERM made an engine leader leave the rollout. With ``rollout.offload_train_state``
        (CUDA) every rank's gradient buffers and optimizer states leave the GPU for the duration (the previous
        ``train_step`` consumed the gradients) and are back before it returns.
        """
        if self._offload_enabled:
            self.policy.offload_train_state()
        rollout = collect_step(
            self.collector,
            self.loader,
            step,
            rollout_cfg=self.cfg.rollout,
            algorithm_cfg=self.cfg.algorithm,
            reward_cfg=self.cfg.reward,
            num_engines=self.num_engines,
            group=self._world,
            stop=self.stop_requests,
        )
        if self.collector is not None and rollout is not None and self.cfg.rollout.placement == "colocated":
            self.collector.engine.sleep()
        if self._offload_enabled:
            self.policy.restore_train_state()
        return rollout

    def _old_logprob_pass(self, local: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The no-grad pass before the update (one forward; GTPO_SPEC section 4).

        Returns log pi_old ``[b, S]`` at the loss temperature and the gathered ``[B]`` <H>_i at
        ``entropy_temperature``; adds this step to <H>_ini while the ``paper`` filter measures it.
        """
        old_logprobs, entropy = self.policy.compute_logprobs(
            local, temperature=self.loss_spec.temperature, entropy_temperature=self.loss_spec.entropy_temperature
        )
        local_seq_entropy = sequence_mean_entropy(entropy, local.response_mask)
        self._pool_initial_entropy(local_seq_entropy, local.response_mask.any(dim=-1))
        return old_logprobs, all_gather_rows(local_seq_entropy, group=self._dp_group)

    def _ref_logprob_pass(self, local: TrainBatch) -> torch.Tensor:
        """Log-probs ``[b, S]`` of the frozen reference at the loss temperature (the KL term, GTPO_SPEC section 5)."""
        ref_logprobs, _ = self.reference.compute_logprobs(local, temperature=self.loss_spec.temperature)
        return ref_logprobs

    def _initial_entropy_known(self) -> bool:
        """<H>_ini is final: measured over ``algorithm.initial_entropy_steps`` steps."""
        return self.initial_entropy_steps >= self.cfg.algorithm.initial_entropy_steps

    def _pool_initial_entropy(self, local_seq_entropy: torch.Tensor, has_tokens: torch.Tensor) -> None:
        """Average this step into <H>_ini of the ``paper`` filter while it is measured (section 4).

        <H>_ini is the mean over the first ``initial_entropy_steps`` steps of each step's mean <H>_i (completions
        with a response token); meanwhile the filter uses the running mean.
        """
        if self.cfg.algorithm.entropy_filter != "paper" or self._initial_entropy_known():
            return
        step_mean = float(global_mean(local_seq_entropy, group=self._dp_group, mask=has_tokens))
        done = self.initial_entropy_steps
        self.initial_entropy = ((self.initial_entropy or 0.0) * done + step_mean) / (done + 1)
        self.initial_entropy_steps = done + 1

    def _train_batch(
        self,
        local: TrainBatch,
        weights: StepWeights,
        rows: slice,
        old_logprobs: torch.Tensor | None,
        seq_entropy: torch.Tensor | None,
    ) -> TrainBatch:
        local.advantages = weights.raw_advantages[rows]
        local.token_weights = weights.token_weights[rows]
        local.keep_mask = weights.keep_mask[rows]
        local.seq_entropy = None if seq_entropy is None else seq_entropy[rows]
        local.loss_row_mask = weights.loss_row_mask[rows]
        # One update per batch: r = exp(logp - stopgrad(logp)) = 1 with gradient (GTPO_SPEC section 1).
        local.old_logprobs = old_logprobs if self.cfg.algorithm.num_updates_per_batch > 1 else None
        local.rollout_logprobs = local.extras["rollout_logprobs"] if self._measure_mismatch else None
        return local

    def _train(self, batch: TrainBatch, spec: LossSpec) -> dict[str, float]:
        """``num_updates_per_batch`` optimizer steps; the mismatch is measured by the first (before any update)."""
        metrics: dict[str, float] = {}
        for _ in range(self.cfg.algorithm.num_updates_per_batch):
            metrics.update(self.policy.train_step(batch, spec))
            batch.rollout_logprobs = None
        return metrics

    def _sync_weights(self) -> dict[str, float]:
        """Stream the new weights into every engine (``rollout.push``); replica 0's ranks drive the gather."""
        if self.collector is not None:
            self.collector.engine.wake_up()
        return self.weight_sync.sync(self.policy.iter_hf_weights)

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
            self.save(completed_step, state=self._completed_state)
        self.sink.write(
            f"{what}: step {completed_step + 1} aborted; step {completed_step} saved; resume with resume=true"
        )

    def _trainer_state(self, step: int) -> dict:
        """The trainer's part of a checkpoint after ``step`` completed steps: <H>_ini and the loader position."""
        return {
            "step": step,
            "initial_entropy": self.initial_entropy,
            "initial_entropy_steps": self.initial_entropy_steps,
            "loader": self.loader.state_dict(),
        }

    def save(self, step: int, *, state: dict | None = None) -> None:
        """Checkpoint model, optimizer and trainer state under ``checkpoints/step_NNNNNN``; prune old ones.

        ``state``: the trainer state to store (``_trainer_state``), taken before an aborted step began, whose
        rollout already moved the loader; default: the current one.
        """
        state = state or self._trainer_state(step)
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
        self._restore_initial_entropy(state, newest)
        if state.get("loader") is not None:
            self.loader.load_state_dict(state["loader"])
        self._sync_weights()
        logger.info("resumed from %s (step %d)", newest, state["step"])
        return int(state["step"])

    def _restore_initial_entropy(self, state: dict, path) -> None:
        """<H>_ini from a checkpoint's trainer state; refuse to measure it on a trained policy.

        Raises:
            ValueError: the ``paper`` filter, and the checkpoint measured <H>_ini over fewer steps than it
                completed and than ``algorithm.initial_entropy_steps`` (e.g. a run started with another filter):
                measuring now would read the trained policy's entropy instead of the initial one (section 4).
        """
        self.initial_entropy = state.get("initial_entropy")
        legacy = 0 if self.initial_entropy is None else 1  # checkpoints before the step count was saved
        self.initial_entropy_steps = int(state.get("initial_entropy_steps", legacy))
        cfg, done = self.cfg.algorithm, int(state["step"])
        if cfg.entropy_filter == "paper" and self.initial_entropy_steps < min(cfg.initial_entropy_steps, done):
            raise ValueError(
                f"resume=true with algorithm.entropy_filter=paper: checkpoint {path} (step {done}) holds <H>_ini "
                f"measured over {self.initial_entropy_steps} of the first algorithm.initial_entropy_steps="
                f"{cfg.initial_entropy_steps} steps, and measuring it now would read the trained policy, not the "
                "initial one (GTPO_SPEC section 4); resume with the entropy filter the run was started with, or set "
                "algorithm.entropy_filter=fixed with algorithm.entropy_threshold=TAU, or start a fresh run "
                "(resume=false, a new output_dir)"
            )

    def close(self) -> None:
        """Close the engine, the reward pool and the sink (rank 0), each whatever the others do; idempotent."""
        steps = [("the metric sink", self.sink.close)]
        if self.collector is not None:
            steps[:0] = [
                ("the rollout engine", self.collector.engine.close),
                ("the reward pool", self.collector.reward_pool.close),
            ]
        close_all(steps)


def _cuda_available() -> bool:
    """Whether this process trains on CUDA (a function so that CPU tests can pretend)."""
    return torch.cuda.is_available()
