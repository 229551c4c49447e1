"""The GTPO training loop: orchestration only (the math is in ``ops`` and ``algorithm``, the model behind ``Policy``).

``Trainer.step`` reads as the algorithm: rollout -> a no-grad pass before the update only where needed -> the
reference's pass (KL term) -> advantages and conflict weights on the full batch -> train -> weight sync -> metrics.
``rollout.mode: async`` takes the rollout sampled ahead and queues the weights between the engines' batches
(``rollout.pipeline.AsyncRollouts``). ``run`` adds resume, logging and checkpoints (``resume.RunCheckpoints``).
Stop signals (``preemption``): SIGUSR1 saves at the next step boundary; SIGTERM and SIGINT abort the step in flight
at its next wait or safe point (the rollout, before the update, before the sync, after an async drain, the step's
end: one MAX all-reduce on the world each) and save the last completed step; a step whose update began is finished
without its weight sync and saved.
Every collective goes through ``parallel.collectives`` (listed per method).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from gtpo_megatron import run_dir
from gtpo_megatron.algorithm import StepWeights, build_loss_spec, compute_step_weights, needs_old_logprob_pass
from gtpo_megatron.batch import TrainBatch
from gtpo_megatron.config import GTPOConfig
from gtpo_megatron.initial_entropy import InitialEntropy
from gtpo_megatron.logging import MetricSink, PhaseTimer, format_step_line, plot_curves
from gtpo_megatron.ops import sequence_mean_entropy
from gtpo_megatron.ops.off_policy import staleness_mask, staleness_stats
from gtpo_megatron.parallel import all_gather_rows, any_rank
from gtpo_megatron.plan.micro_batches import dp_rows
from gtpo_megatron.preemption import StopRequests
from gtpo_megatron.resume import RunCheckpoints
from gtpo_megatron.rollout.batch import collate_completions, collate_token_versions
from gtpo_megatron.rollout.collector import RolloutCollector, StepRollout, collect_step
from gtpo_megatron.rollout.engine_guard import close_all
from gtpo_megatron.rollout.pipeline import AsyncRollouts
from gtpo_megatron.rollout.push import CollectiveWeightSync, FilesWeightSync
from gtpo_megatron.step_metrics import measures_mismatch, step_metrics

if TYPE_CHECKING:
    from gtpo_megatron.data.loader import PromptLoader
    from gtpo_megatron.ops import LossSpec
    from gtpo_megatron.parallel.groups import ParallelGroups
    from gtpo_megatron.policy import Policy, ReferencePolicy
    from gtpo_megatron.rollout.adapter_sync import AdapterWeightSync
    from gtpo_megatron.rollout.exchange import StepExchange
    from gtpo_megatron.rollout.fault_tolerance import FaultTolerance

logger = logging.getLogger(__name__)


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
        exchange: the step exchange on the world group (``build.build_exchange``).
        pad_token_id: padding id of the batches.
        sink: the metric sink (enabled on rank 0 only).
        reference: the frozen reference policy of the KL term (``algorithm.kl_coef > 0``), else None.
        weight_sync: this rank's part of the weight push (``rollout.push``); default: the ``files`` path.
        fault_tolerance: ``rollout.fault_tolerance``'s engine recovery (its rounds; build passes it as weight_sync too).
    """

    def __init__(
        self,
        cfg: GTPOConfig,
        *,
        groups: ParallelGroups,
        policy: Policy,
        collector: RolloutCollector | None,
        loader: PromptLoader,
        exchange: StepExchange,
        pad_token_id: int,
        sink: MetricSink,
        reference: ReferencePolicy | None = None,
        weight_sync: CollectiveWeightSync | FilesWeightSync | AdapterWeightSync | FaultTolerance | None = None,
        fault_tolerance: FaultTolerance | None = None,
    ) -> None:
        self.cfg = cfg
        self.groups = groups
        self.policy = policy
        self.collector = collector
        self.loader = loader
        self.exchange = exchange
        self.pad_token_id = pad_token_id
        self.sink = sink
        self.reference = reference
        self.fault_tolerance = fault_tolerance
        if (reference is None) != (cfg.algorithm.kl_coef == 0):
            raise ValueError(f"algorithm.kl_coef={cfg.algorithm.kl_coef} needs a reference policy exactly when it is "
                             f"> 0; got reference={reference!r} (build.build_trainer builds it)")  # fmt: skip
        self.loss_spec = build_loss_spec(cfg.algorithm, cfg.rollout)
        self.initial_entropy = InitialEntropy(cfg.algorithm)
        self._world = dist.group.WORLD
        self.rollouts = None  # rollout.mode=async: the engines sample ahead (rollout/pipeline.py)
        if cfg.rollout.mode == "async":
            self.rollouts = AsyncRollouts(cfg, collector=collector, loader=loader, exchange=exchange,
                                          recovery=fault_tolerance)  # fmt: skip
        self.checkpoints = RunCheckpoints(
            cfg, policy, loader, self.initial_entropy, rank=groups.rank, group=dist.group.WORLD,
            in_flight=None if self.rollouts is None else (lambda: self.rollouts.in_flight),
        )  # fmt: skip
        self._measure_mismatch = measures_mismatch(self.loss_spec, cfg)
        self._dp_group = groups.dp if groups.dp_size > 1 else None
        self._token_budget = cfg.max_tokens_per_micro_batch is not None  # DP rows balanced by tokens
        self.weight_sync = weight_sync or FilesWeightSync(
            engine=collector.engine if collector is not None else None,
            exporting=groups.in_weight_gather,
            bucket_bytes=cfg.rollout.weight_sync_bucket_mb * 2**20,
        )
        self.stop_requests = StopRequests(
            on_sigterm=cfg.checkpoint.save_on_sigterm, on_sigusr1=cfg.checkpoint.save_on_sigusr1
        )
        self._completed_state: dict | None = None  # the trainer state before the step in flight
        self._offload_enabled = cfg.rollout.offload_train_state and _cuda_available()
        if cfg.rollout.offload_train_state and not self._offload_enabled:
            logger.warning("rollout.offload_train_state=true has no effect without CUDA: the training state already "
                           "lives in host memory")  # fmt: skip

    # ------------------------------------------------------------------------------------------------ the step
    def step(self, step: int) -> dict[str, float]:
        """One GTPO step (1-based ``step``); returns its metrics (identical on every rank except timings)."""
        timer = PhaseTimer()
        self._completed_state = self.checkpoints.state(step - 1)  # what an abort of this step saves
        with timer.phase("step"):
            with timer.phase("rollout"):
                rollout = self._rollout(step)
            if rollout is None:  # an abort signal made an engine leader leave the rollout; every rank received None
                raise StepAborted(step - 1)
            batch = collate_completions(rollout.groups, pad_token_id=self.pad_token_id)
            rows = torch.tensor(dp_rows(batch.sequence_lengths(), dp_size=self.groups.dp_size,
                                        dp_rank=self.groups.dp_rank, by_tokens=self._token_budget))  # fmt: skip
            local = batch.select(rows)
            old_logprobs, seq_entropy = None, None
            if needs_old_logprob_pass(self.cfg.algorithm, initial_entropy_known=self.initial_entropy.known):
                with timer.phase("old_logprob"):
                    old_logprobs, seq_entropy = self._old_logprob_pass(local, rows)
            if self.reference is not None:
                with timer.phase("ref_logprob"):  # the frozen reference (docs/algorithm.md section 9)
                    temperature = self.loss_spec.temperature
                    local.ref_logprobs, _ = self.reference.compute_logprobs(local, temperature=temperature)
            with timer.phase("advantages"):
                spec = dataclasses.replace(self.loss_spec, initial_entropy=self.initial_entropy.value)
                rewards, scores = torch.tensor(rollout.rewards), torch.tensor(rollout.scores)
                weights = compute_step_weights(
                    batch, rewards, self.cfg.algorithm, loss_spec=spec, seq_entropy=seq_entropy, scores=scores
                )
                train_batch = self._train_batch(local, weights, rows, old_logprobs, seq_entropy)
            staleness = {}
            if self.cfg.rollout.partial_rollouts:  # tokens past the staleness bound leave the loss
                staleness = self._drop_stale_tokens(step, rollout, batch, train_batch, rows)
            if self._agree(self.stop_requests.abort_requested):  # safe point: the weights are still step - 1's
                raise StepAborted(step - 1)
            with timer.phase("train"):
                train_metrics = self._train(train_batch, spec)
            aborting = self._agree(self.stop_requests.abort_requested)  # the update is done: skip only the sync
            with timer.phase("sync"):
                sync_metrics = {} if aborting else self._after_update(step)
        measured, entropy = {**sync_metrics, **staleness, **timer.seconds}, self.initial_entropy.value
        return step_metrics(rollout, batch, weights, train_metrics, measured, initial_entropy=entropy,
                            with_reference=self.reference is not None)  # fmt: skip

    def _rollout(self, step: int) -> StepRollout | None:
        """Engine leaders sample and score; every rank gets the step (None on every rank after an abort signal).

        With ``rollout.offload_train_state`` (CUDA) the gradient buffers and optimizer states leave the GPU meanwhile.
        Collectives: the rollout exchange (``collect_step``, world).
        """
        if self.rollouts is not None:
            return self.rollouts.take(step, self.stop_requests)
        if self._offload_enabled:
            self.policy.offload_train_state()
        rollout = collect_step(self.collector, self.loader, step, self.exchange, stop=self.stop_requests,
                               recovery=self.fault_tolerance)  # fmt: skip
        if self.collector is not None and rollout is not None and self.cfg.rollout.placement == "colocated":
            self.collector.engine.sleep()
        if self._offload_enabled:
            self.policy.restore_train_state()
        return rollout

    def _old_logprob_pass(self, local: TrainBatch, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The no-grad pass before the update (one forward; docs/algorithm.md section 4).

        Returns log pi_old ``[b, S]`` at the loss temperature and the gathered ``[B]`` <H>_i (batch order; ``rows``
        are this rank's) at ``entropy_temperature``; adds this step to <H>_ini while the ``paper`` filter
        measures it. Collectives: one all-gather of the sequence entropies and, while <H>_ini is measured, one
        global mean (dp).
        """
        old_logprobs, entropy = self.policy.compute_logprobs(
            local, temperature=self.loss_spec.temperature, entropy_temperature=self.loss_spec.entropy_temperature
        )
        local_seq_entropy = sequence_mean_entropy(entropy, local.response_mask)
        self.initial_entropy.add_step(local_seq_entropy, local.response_mask.any(dim=-1), group=self._dp_group)
        return old_logprobs, all_gather_rows(local_seq_entropy, group=self._dp_group, rows=rows)

    def _train_batch(self, local: TrainBatch, weights: StepWeights, rows: torch.Tensor,
                     old_logprobs: torch.Tensor | None, seq_entropy: torch.Tensor | None) -> TrainBatch:  # fmt: skip
        local.advantages = weights.raw_advantages[rows]
        local.token_weights = weights.token_weights[rows]
        local.seq_entropy = None if seq_entropy is None else seq_entropy[rows]
        local.loss_row_mask = weights.loss_row_mask[rows]
        # One update per batch: r = exp(logp - stopgrad(logp)) = 1 with gradient (docs/algorithm.md section 1).
        local.old_logprobs = old_logprobs if self.cfg.algorithm.num_updates_per_batch > 1 else None
        local.rollout_logprobs = local.rollout_logprobs if self._measure_mismatch else None
        return local

    def _drop_stale_tokens(
        self, step: int, rollout: StepRollout, batch: TrainBatch, train_batch: TrainBatch, rows: torch.Tensor
    ) -> dict[str, float]:
        """Drop this rank's tokens over ``rollout.max_staleness`` versions old from the loss (docs/algorithm.md 11).

        The version histogram is the whole batch's, the same on every rank.
        """
        versions = collate_token_versions(rollout.groups, batch.input_ids.shape[1])
        k = self.cfg.rollout.max_staleness
        mask = staleness_mask(versions, batch.response_mask, policy_version=step - 1, max_staleness=k)
        train_batch.response_mask = mask.keep_BT[rows]
        return staleness_stats(mask, batch.response_mask, max_staleness=k)

    def _train(self, batch: TrainBatch, spec: LossSpec) -> dict[str, float]:
        """``num_updates_per_batch`` optimizer steps, each with the behaviour log-probs (the mismatch is pi_old's)."""
        metrics: dict[str, float] = {}
        for _ in range(self.cfg.algorithm.num_updates_per_batch):
            metrics.update(self.policy.train_step(batch, spec))
        return metrics

    def _after_update(self, step: int) -> dict[str, float]:
        """The weight sync after ``step``'s update; async: queued between the engines' batches (``AsyncRollouts``).

        No push after the last step (no rollout samples its weights). Async with ``collective`` sync: an abort signal
        during the drain skips the push (safe point: one MAX all-reduce on the world).
        """
        if self.rollouts is None:
            return self._sync_weights() if step < self.cfg.trainer.max_steps else {}
        return self.rollouts.push(step, self.weight_sync, self.policy.iter_hf_weights, self.stop_requests)

    def _sync_weights(self) -> dict[str, float]:
        """Stream the new weights into every engine (``rollout.push``); replica 0's ranks drive the gather."""
        if self.collector is not None:
            self.collector.engine.wake_up()
        return self.weight_sync.sync(self.policy.iter_hf_weights)

    # ------------------------------------------------------------------------------------------------ the loop
    def run(self) -> None:
        """Resume if asked, run the remaining steps with logging and checkpoints, then plot the curves."""
        start = self.checkpoints.resume()
        if start or self.cfg.model.megatron_checkpoint is not None:
            self._sync_weights()  # the engine holds the HF folder's (or, for a Megatron checkpoint, dummy) weights
        with self.stop_requests.installed():
            if self.rollouts is not None:
                self.rollouts.start(start)  # the engines sample ahead once the stop signals are handled
            for step in range(start + 1, self.cfg.trainer.max_steps + 1):
                try:
                    metrics = self.step(step)
                except StepAborted as aborted:
                    said = self.checkpoints.save_after_abort(aborted.completed_step, self._completed_state)
                    self.sink.write(f"{self.stop_requests.describe()}: {said}")
                    break
                self.sink.log(step, metrics)
                if step % self.cfg.trainer.log_every == 0:
                    self.sink.write(format_step_line(step, metrics))
                stop = self._agree(self.stop_requests.stop_requested)
                every = self.cfg.checkpoint.every_n_steps
                if stop or step == self.cfg.trainer.max_steps or (every and step % every == 0):
                    self.checkpoints.save(step)
                if stop:
                    self.sink.write(f"{self.stop_requests.describe()}: saved step {step} and stopped; resume with "
                                    "resume=true")  # fmt: skip
                    break
        if self.groups.rank == 0 and self.sink.path.exists():
            plot_curves(self.sink.path, run_dir.curves_path(self.cfg.output_dir))

    def _agree(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is True on any rank (one MAX all-reduce on the world)."""
        return any_rank(flag, group=self._world)

    def close(self) -> None:
        """Close the engine, the reward pool and the sink (rank 0), each whatever the others do; idempotent."""
        parts = [("the async rollouts", self.rollouts), ("the restarting engine", self.fault_tolerance)]
        if self.collector is not None:
            parts[:0] = [("the rollout engine", self.collector.engine), ("the reward pool", self.collector.reward_pool)]
        close_all(
            [(name, part.close) for name, part in parts if part is not None] + [("the metric sink", self.sink.close)]
        )


def _cuda_available() -> bool:
    """Whether this process trains on CUDA (a function so that CPU tests can pretend)."""
    return torch.cuda.is_available()
