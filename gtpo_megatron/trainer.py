"""The GTPO training loop: orchestration only (the math is in ``ops``, the model in ``megatron_adapter``).

A step, as ``Trainer.step`` reads: rollout (rank 0 samples and scores, then broadcasts) -> old-logprob pass
(each data-parallel rank on its rows) -> advantages, entropy filter and conflict weights on the full batch
(GTPO_SPEC sections 2-4) -> train (``policy.train_step``) -> weight sync into the engine -> metrics. ``run``
adds logging and checkpoints (every ``checkpoint.every_n_steps``, after the last step and on SIGTERM).

Ranks: global rank 0 owns the rollout engine and the reward pool (``RolloutCollector``); every rank receives the
whole step's completions (``broadcast_object_list`` on the world), builds the same full batch and keeps its
data-parallel share. Collectives per step: one object broadcast (world), an all-reduce of the sequence entropies
and one of the mismatch sums (dp), the policy's own, the weight gather (model-parallel group of dp replica 0) and
one MAX all-reduce of the stop flag (world).
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from gtpo_megatron.config import GTPOConfig
from gtpo_megatron.logging import MetricSink, format_step_line, get_logger, plot_curves
from gtpo_megatron.ops import sequence_mean_entropy
from gtpo_megatron.parallel import all_reduce_sum, reduce_metric_sums
from gtpo_megatron.algorithm import compute_step_weights, weight_metrics
from gtpo_megatron.rollout.batch import collate_completions, mismatch_sums, rollout_metrics, shard_rows
from gtpo_megatron.rollout.collector import RolloutCollector, StepRollout
from gtpo_megatron.rollout.push import push_weights
from gtpo_megatron.rollout.types import TrainBatch

CHECKPOINT_PREFIX = "step_"
logger = get_logger(__name__)


class PhaseTimer:
    """Wall-clock seconds per named phase, reported as ``time/<name>_s``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        yield
        self.seconds[f"time/{name}_s"] = time.perf_counter() - start


class Trainer:
    """Runs ``cfg.trainer.max_steps`` GTPO steps.

    Args:
        cfg: the resolved run config (validated for this world size).
        groups: ``parallel.groups.ParallelGroups``.
        policy: ``MegatronPolicy`` (or an object with the same methods).
        collector: the rank-0 ``RolloutCollector``; None on other ranks.
        pad_token_id: padding id of the batches.
        sink: the metric sink (enabled on rank 0 only).
    """

    def __init__(self, cfg: GTPOConfig, *, groups, policy, collector: RolloutCollector | None, pad_token_id: int,
                 sink: MetricSink) -> None:
        self.cfg = cfg
        self.groups = groups
        self.policy = policy
        self.collector = collector
        self.pad_token_id = pad_token_id
        self.sink = sink
        self.checkpoint_dir = Path(cfg.output_dir) / "checkpoints"
        self.initial_entropy: float | None = None
        self.loader_state: dict | None = None
        self._stop_requested = False
        self._offload_enabled = cfg.rollout.offload_train_state and _cuda_available()
        if cfg.rollout.offload_train_state and not self._offload_enabled:
            logger.warning("rollout.offload_train_state=true has no effect without CUDA: the training state "
                           "already lives in host memory")

    # ------------------------------------------------------------------------------------------------ the step
    def step(self, step: int) -> dict[str, float]:
        """One GTPO step (1-based ``step``); returns its metrics (identical on every rank except timings)."""
        timer = PhaseTimer()
        with timer.phase("step"):
            with timer.phase("rollout"):
                rollout = self._rollout(step)
            batch = collate_completions(rollout.groups, pad_token_id=self.pad_token_id)
            local = shard_rows(batch, dp_rank=self.groups.dp_rank, dp_size=self.groups.dp_size)
            with timer.phase("old_logprob"):
                old_logprobs, entropy = self._old_logprob_pass(local)
            with timer.phase("advantages"):
                seq_entropy = self._gather_rows(sequence_mean_entropy(entropy, local.response_mask), batch)
                weights = self._advantages(batch, rollout, seq_entropy)
                train_batch = self._train_batch(local, weights, old_logprobs)
            with timer.phase("train"):
                train_metrics = self._train(train_batch)
            with timer.phase("sync"):
                sync_metrics = self._sync_weights()
        metrics = rollout_metrics(batch, torch.tensor(rollout.scores), torch.tensor(rollout.correct),
                                  torch.tensor(rollout.format_ok))
        metrics.update(weight_metrics(weights, batch.response_mask))
        metrics.update(self._entropy_and_mismatch(seq_entropy, old_logprobs, local))
        metrics.update({f"train/{k}": v for k, v in train_metrics.items()})
        metrics.update({**rollout.stats, **sync_metrics, **timer.seconds})
        metrics["perf/tokens_per_s"] = float(batch.attention_mask.sum()) / metrics["time/step_s"]
        metrics["perf/response_tokens_per_s"] = float(batch.response_mask.sum()) / metrics["time/step_s"]
        self.loader_state = rollout.loader_state
        return metrics

    def _rollout(self, step: int) -> StepRollout:
        """Rank 0 samples and scores (engine sleeps afterwards when colocated); every rank gets the result.

        With ``rollout.offload_train_state`` (CUDA) every rank's gradient buffers and optimizer states leave the
        GPU for the duration (the previous ``train_step`` consumed the gradients) and are back before it returns.
        """
        box: list[StepRollout | None] = [None]
        if self._offload_enabled:
            self.policy.offload_train_state()
        if self.collector is not None:
            box[0] = self.collector.collect(step)
            if self.cfg.rollout.placement == "colocated":
                self.collector.engine.sleep()
        dist.broadcast_object_list(box, src=0)
        if self._offload_enabled:
            self.policy.restore_train_state()
        return box[0]

    def _old_logprob_pass(self, local: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """log pi_old at the sampling temperature and entropy at ``entropy_temperature`` (section 4), ``[b, S]``."""
        temperature = self.cfg.rollout.temperature
        old_logprobs, entropy = self.policy.compute_logprobs(local, temperature=temperature)
        if self.cfg.algorithm.entropy_temperature != temperature:
            _, entropy = self.policy.compute_logprobs(local, temperature=self.cfg.algorithm.entropy_temperature)
        return old_logprobs, entropy

    def _gather_rows(self, local_values: torch.Tensor, batch: TrainBatch) -> torch.Tensor:
        """``[B]`` from each data-parallel rank's ``[B/dp]`` share (one SUM all-reduce on the dp group)."""
        share = local_values.shape[0]
        full = torch.zeros(batch.num_sequences, dtype=torch.float32)
        full[self.groups.dp_rank * share:(self.groups.dp_rank + 1) * share] = local_values
        return all_reduce_sum(full, group=self.groups.dp if self.groups.dp_size > 1 else None)

    def _advantages(self, batch: TrainBatch, rollout: StepRollout, seq_entropy: torch.Tensor):
        algorithm = self.cfg.algorithm
        if algorithm.entropy_filter == "paper" and self.initial_entropy is None:
            has_tokens = batch.response_mask.any(dim=-1)
            self.initial_entropy = float(seq_entropy[has_tokens].mean()) if has_tokens.any() else 0.0
        return compute_step_weights(batch, torch.tensor(rollout.rewards), seq_entropy, algorithm,
                                    initial_entropy=self.initial_entropy)

    def _train_batch(self, local: TrainBatch, weights, old_logprobs: torch.Tensor) -> TrainBatch:
        rows = slice(self.groups.dp_rank * local.num_sequences, (self.groups.dp_rank + 1) * local.num_sequences)
        local.advantages = weights.advantages[rows]
        local.token_weights = weights.token_weights[rows]
        # One update per batch: r = exp(logp - stopgrad(logp)) = 1 with gradient (GTPO_SPEC section 1).
        local.old_logprobs = old_logprobs if self.cfg.algorithm.num_updates_per_batch > 1 else None
        return local

    def _train(self, batch: TrainBatch) -> dict[str, float]:
        algorithm = self.cfg.algorithm
        metrics: dict[str, float] = {}
        for _ in range(algorithm.num_updates_per_batch):
            metrics = self.policy.train_step(
                batch, loss_name=algorithm.name, aggregation=algorithm.aggregation,
                clip_eps_low=algorithm.clip_eps_low, clip_eps_high=algorithm.clip_eps_high,
                kl_coef=algorithm.kl_coef, kl_estimator=algorithm.kl_estimator,
                temperature=self.cfg.rollout.temperature,
                max_response_length=self.cfg.rollout.max_tokens if algorithm.name == "dr_grpo" else None)
        return metrics

    def _sync_weights(self) -> dict[str, float]:
        """Stream the new weights into the engine (rank 0); the other ranks of replica 0 drive the gather."""
        if self.collector is not None:
            self.collector.engine.wake_up()
            bucket_bytes = self.cfg.rollout.weight_sync_bucket_mb * 2**20
            return push_weights(self.collector.engine, self.policy.iter_hf_weights(),
                                bucket_bytes=bucket_bytes).as_metrics()
        if self.groups.dp_rank == 0:
            for _ in self.policy.iter_hf_weights():
                pass
        return {}

    def _entropy_and_mismatch(self, seq_entropy: torch.Tensor, old_logprobs: torch.Tensor,
                              local: TrainBatch) -> dict[str, float]:
        sums = mismatch_sums(old_logprobs, local.extras["rollout_logprobs"], local.response_mask)
        sums = reduce_metric_sums(sums, group=self.groups.dp if self.groups.dp_size > 1 else None)
        count = max(float(sums["count"]), 1.0)
        out = {"entropy/mean": float(seq_entropy.mean()),
               "mismatch/abs_logprob_diff": float(sums["abs_logprob_diff"]) / count,
               "mismatch/prob_ratio_err": float(sums["prob_ratio_err"]) / count}
        if self.initial_entropy is not None:
            out["entropy/initial"] = self.initial_entropy
        return out

    # ------------------------------------------------------------------------------------------------ the loop
    def run(self) -> None:
        """Resume if asked, run the remaining steps with logging and checkpoints, then plot the curves."""
        start = self._maybe_resume()
        previous = signal.signal(signal.SIGTERM, self._on_sigterm) if self.cfg.checkpoint.save_on_sigterm else None
        try:
            for step in range(start + 1, self.cfg.trainer.max_steps + 1):
                metrics = self.step(step)
                self.sink.log(step, metrics)
                if step % self.cfg.trainer.log_every == 0:
                    self.sink.write(format_step_line(step, metrics))
                stop = self._agree_on_stop()
                every = self.cfg.checkpoint.every_n_steps
                if stop or step == self.cfg.trainer.max_steps or (every and step % every == 0):
                    self.save(step)
                if stop:
                    self.sink.write(f"SIGTERM: saved step {step} and stopped; resume with resume=true")
                    break
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
        if self.groups.rank == 0 and self.sink.path.exists():
            plot_curves(self.sink.path, Path(self.cfg.output_dir) / "curves.png")

    def _on_sigterm(self, signum, frame) -> None:
        self._stop_requested = True

    def _agree_on_stop(self) -> bool:
        """True on every rank when any rank got SIGTERM (one MAX all-reduce on the world)."""
        flag = torch.tensor([1.0 if self._stop_requested else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def save(self, step: int) -> None:
        """Checkpoint model, optimizer and trainer state under ``checkpoints/step_NNNNNN``; prune old ones."""
        state = {"step": step, "initial_entropy": self.initial_entropy, "loader": self.loader_state}
        self.policy.save_checkpoint(str(self.checkpoint_dir / f"{CHECKPOINT_PREFIX}{step:06d}"), state)
        dist.barrier()
        if self.groups.rank == 0:
            for old in list_checkpoints(self.checkpoint_dir)[:-self.cfg.checkpoint.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        dist.barrier()

    def _maybe_resume(self) -> int:
        """Load the newest checkpoint when ``resume=true``; returns the number of completed steps."""
        checkpoints = list_checkpoints(self.checkpoint_dir) if self.cfg.resume else []
        if not checkpoints:
            if self.cfg.resume:
                logger.warning("resume=true but %s holds no checkpoint; starting from step 0", self.checkpoint_dir)
            return 0
        state = self.policy.load_checkpoint(str(checkpoints[-1]))
        self.initial_entropy = state.get("initial_entropy")
        self.loader_state = state.get("loader")
        if self.collector is not None and self.loader_state is not None:
            self.collector.loader.load_state_dict(self.loader_state)
        self._sync_weights()
        logger.info("resumed from %s (step %d)", checkpoints[-1], state["step"])
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


def list_checkpoints(folder: Path) -> list[Path]:
    """Complete checkpoint folders ``step_NNNNNN`` in ``folder``, oldest first (temporary folders ignored)."""
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX)
                  and p.name[len(CHECKPOINT_PREFIX):].isdigit())
