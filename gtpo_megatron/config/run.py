"""The ``trainer``, ``checkpoint`` and ``logging`` sections and the root ``GTPOConfig`` (its cross-section checks)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from gtpo_megatron.config.algorithm import AlgorithmConfig
from gtpo_megatron.config.checks import require as _require
from gtpo_megatron.config.lora import MLP_PROJECTIONS
from gtpo_megatron.config.model import ModelConfig, OptimConfig, ParallelConfig
from gtpo_megatron.config.rollout import ENGINE_LORA_RANKS, DataConfig, RewardConfig, RolloutConfig
from gtpo_megatron.plan import engines, layout, waits
from gtpo_megatron.plan.architectures import architecture_from_hf_config


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainerConfig:
    """Length of the run, seed and log cadence (``trainer.*``)."""

    max_steps: int = 20
    """Training steps (one rollout batch each)."""
    seed: int = 0
    """Seed of model init RNGs and of everything not seeded elsewhere."""
    log_every: int = 1
    """Print a log line every this many steps (metrics.jsonl gets every step)."""

    def __post_init__(self) -> None:
        _require(self.max_steps >= 1, "trainer.max_steps", self.max_steps, "must be >= 1", "use e.g. 20")
        _require(self.log_every >= 1, "trainer.log_every", self.log_every, "must be >= 1", "use 1")


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointConfig:
    """When checkpoints are written and how many are kept (``checkpoint.*``)."""

    every_n_steps: int = 10
    """Save every N steps (and after the last step); 0 saves only at the end and on a stop signal."""
    keep_last: int = 2
    """Checkpoints kept under output_dir/checkpoints (older ones are deleted)."""
    save_on_sigterm: bool = True
    """On SIGTERM (preemption; SIGKILL follows ~30 s later) or SIGINT (Ctrl-C) abort the step in flight at its next
    wait or safe point, save the last completed step and exit cleanly (``gtpo_megatron.preemption``)."""
    save_on_sigusr1: bool = True
    """On SIGUSR1 (Slurm's early warning, ``--signal=B:USR1@<seconds>`` in ``launch/submit.sbatch``) finish the
    step in flight, save it and exit cleanly."""

    def __post_init__(self) -> None:
        _require(self.every_n_steps >= 0, "checkpoint.every_n_steps", self.every_n_steps, "must be >= 0", "use 10")
        _require(self.keep_last >= 1, "checkpoint.keep_last", self.keep_last, "must be >= 1", "use 2")


@dataclass(frozen=True, kw_only=True, slots=True)
class LoggingConfig:
    """Metric mirrors: wandb and the progress bar (``logging.*``)."""

    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    """wandb mode; the environment variable WANDB_MODE wins when set. Offline needs no network."""
    wandb_project: str = "gtpo-megatron"
    progress: bool = True
    """Show a progress bar on rank 0."""
    verbose: bool = False
    """Show third-party logs in full: vLLM's INFO lines (engine configuration, loads, requests) and the warnings
    hidden as harmless here (vLLM's, listed in ``rollout/vllm_logging.py``; Megatron's fallbacks for absent Apex and
    Transformer Engine, named once instead: ``logging.quiet_known_warnings``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GTPOConfig:
    """The root config: the sections, the run folder and ``resume``; ``validate`` checks it for a world size."""

    model: ModelConfig
    output_dir: str
    """Run folder: config.yaml, metrics.jsonl, curves.png, checkpoints/."""
    resume: bool = False
    """Continue from the last checkpoint in output_dir/checkpoints (same data order)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @property
    def engine_dtype(self) -> str:
        """The engines' weight dtype: ``rollout.dtype``, or ``model.params_dtype`` when ``auto``."""
        return self.model.params_dtype if self.rollout.dtype == "auto" else self.rollout.dtype

    @property
    def max_tokens_per_micro_batch(self) -> int | None:
        """The token budget: ``optim.max_tokens_per_micro_batch``, or with ``optim.packing`` alone that of full rows.

        Full rows: ``micro_batch_size * (rollout.max_prompt_len + rollout.max_tokens)``; None: by rows.
        """
        if self.optim.max_tokens_per_micro_batch is not None or not self.optim.packing:
            return self.optim.max_tokens_per_micro_batch
        return self.optim.micro_batch_size * (self.rollout.max_prompt_len + self.rollout.max_tokens)

    @property
    def longest_wait_s(self) -> float:
        """The longest a rank waits in a world collective for an engine leader (``plan.waits.longest_wait_s``)."""
        rollout, reward = self.rollout, self.reward
        return waits.longest_wait_s(
            mode=rollout.mode,
            timeout_s=rollout.timeout_s,
            max_staleness=rollout.max_staleness,
            num_answers=rollout.num_prompts * self.algorithm.group_size,
            reward_workers=reward.num_workers,
            reward_timeout_s=reward.timeout_s,
            fault_tolerance=rollout.fault_tolerance,
        )

    @property
    def world_timeout_s(self) -> float:
        """The world group's collective timeout: :attr:`longest_wait_s` + ``plan.waits.WORLD_TIMEOUT_MARGIN_S``."""
        return self.longest_wait_s + waits.WORLD_TIMEOUT_MARGIN_S

    def validate(self, world_size: int, *, hf_config: dict | None = None) -> None:
        """Cross-section checks once the world size is known (``megatron_adapter.validation.validate_config`` wraps it).

        The planner's rules (``plan.layout``, ``plan.engines``): tp*pp divides the world size, P*G splits over dp
        and the per-rank share into micro-batches, an explicit ``rollout.num_engines`` tiles the world (colocated)
        or the engine GPUs (separate), and, given the model's ``hf_config``, tp divides the attention heads and KV
        heads (unless ``model.pad_attention_heads``), pp the layers, and prompt + completion fit its
        ``max_position_embeddings``.

        Raises:
            ValueError: naming the fields, the values, the rule and a fix (every layout problem at once).
        """
        _require(
            self.rollout.mode == "sync" or not self.algorithm.dynamic_sampling,
            "rollout.mode/algorithm.dynamic_sampling",
            (self.rollout.mode, self.algorithm.dynamic_sampling),
            "dynamic sampling decides its rounds with every engine's scores, which async rollouts do not wait for",
            "set algorithm.dynamic_sampling=false, or rollout.mode=sync",
        )
        lag = self.rollout.max_staleness if self.rollout.mode == "async" else 0
        _require(
            lag <= 1 or self.algorithm.off_policy_correction != "none",
            "algorithm.off_policy_correction/rollout.max_staleness",
            (self.algorithm.off_policy_correction, lag),
            "a lag above one step needs a truncated or masked importance weight (docs/algorithm.md section 11: an "
            "uncorrected or unclipped one destabilises training there)",
            "set algorithm.off_policy_correction=tis (or mis) with algorithm.loss_temperature=sampling, or "
            "rollout.max_staleness=1",
        )
        _require(
            not self.rollout.partial_rollouts or self.algorithm.off_policy_correction != "none",
            "algorithm.off_policy_correction/rollout.partial_rollouts",
            (self.algorithm.off_policy_correction, self.rollout.partial_rollouts),
            "a completion sampled across a weight update has tokens of two behaviour policies, each needing its own "
            "clipped importance weight (docs/algorithm.md section 11)",
            "set algorithm.off_policy_correction=tis (or mis) with algorithm.loss_temperature=sampling, or "
            "rollout.partial_rollouts=false",
        )
        self._validate_lora(num_experts=None)
        tp, pp = self.parallel.tp_size, self.parallel.pp_size
        dp = max(world_size // (tp * pp), 1)
        hf = hf_config
        arch = None if hf is None else architecture_from_hf_config(hf, name=self.model.name_or_path)
        problems = layout.world_problems(
            world_size,
            tp_size=tp,
            pp_size=pp,
            ep_size=self.parallel.ep_size,
            num_experts=0 if arch is None else arch.num_experts,
            described=f"the world size {world_size}",
            launch=f"a multiple of {tp * pp} ranks",
        )
        problems += layout.batch_problems(
            num_prompts=self.rollout.num_prompts,
            group_size=self.algorithm.group_size,
            dp_size=dp,
            # a token budget forms its own micro-batches: any number of rows per rank
            micro_batch_size=self.optim.micro_batch_size if self.max_tokens_per_micro_batch is None else 1,
        )
        if self.rollout.num_engines != "auto":
            problems += engines.engine_count_problems(
                self.rollout.num_engines,
                placement=self.rollout.placement,
                train_world_size=world_size,
                engine_tp_size=self.rollout.engine_tp_size,
                pool_gpus=engines.engine_pool_gpus(
                    placement=self.rollout.placement,
                    engine_tp_size=self.rollout.engine_tp_size,
                    num_engine_gpus=self.rollout.num_engine_gpus,
                ),
            )
        if arch is not None:
            problems += layout.model_problems(
                arch, tp_size=tp, pp_size=pp, pad_attention_heads=self.model.pad_attention_heads
            )
            problems += layout.expert_problems(
                arch,
                ep_size=self.parallel.ep_size,
                tp_size=tp,
                sequence_parallel=self.parallel.sequence_parallel,
                stage_ranks=world_size // pp if world_size % (tp * pp) == 0 else None,
            )
        layout.raise_problems(problems)
        self._validate_token_budget()
        if hf is not None:
            self._validate_sequence_length(hf.get("max_position_embeddings"))
            self._validate_routing_replay(num_experts=arch.num_experts)
            self._validate_lora(num_experts=arch.num_experts)

    def _validate_token_budget(self) -> None:
        budget = self.max_tokens_per_micro_batch
        prompt, total = self.rollout.max_prompt_len, self.rollout.max_prompt_len + self.rollout.max_tokens
        _require(
            budget is None or budget >= prompt,
            "optim.max_tokens_per_micro_batch",
            budget,
            f"is smaller than the longest prompt (rollout.max_prompt_len={prompt}), so no sequence fits",
            f"raise it to at least rollout.max_prompt_len + rollout.max_tokens = {total}",
        )
        _require(
            budget is None or budget >= total,
            "optim.max_tokens_per_micro_batch",
            budget,
            f"is smaller than the longest sequence (rollout.max_prompt_len + rollout.max_tokens = {total}); a "
            "sequence is never split over micro-batches",
            f"raise it to at least {total}, or lower rollout.max_tokens",
        )

    def _validate_sequence_length(self, max_pos: int | None) -> None:
        total = self.rollout.max_prompt_len + self.rollout.max_tokens
        _require(
            max_pos is None or total <= max_pos,
            "rollout.max_prompt_len+rollout.max_tokens",
            total,
            f"must not exceed the model's max_position_embeddings={max_pos}",
            "shorten prompts or completions",
        )

    def _validate_routing_replay(self, *, num_experts: int) -> None:
        _require(
            self.rollout.routing_replay == "off" or num_experts > 0,
            "rollout.routing_replay",
            self.rollout.routing_replay,
            f"replays expert choices, but {self.model.name_or_path} is a dense model (no experts to route to)",
            "set rollout.routing_replay=off",
        )

    def _validate_adapter_sync(self) -> None:
        """``rollout.lora_sync: adapter``: engines serving a LoRA request (``rollout/adapter_sync.py``)."""
        rank, fix = self.model.lora.rank, "or set rollout.lora_sync=merged"
        _require(
            rank <= ENGINE_LORA_RANKS[-1], "model.lora.rank", rank,
            f"is above vLLM's largest max_lora_rank ({ENGINE_LORA_RANKS[-1]}) with rollout.lora_sync=adapter",
            f"use a rank <= {ENGINE_LORA_RANKS[-1]} {fix}",
        )  # fmt: skip
        _require(
            self.model.megatron_checkpoint is None, "model.megatron_checkpoint", self.model.megatron_checkpoint,
            "starts the engines with dummy base weights, and rollout.lora_sync=adapter never sends the base",
            f"start from the HF folder (model.megatron_checkpoint=null) {fix}",
        )  # fmt: skip
        _require(
            not self.rollout.fault_tolerance, "rollout.fault_tolerance", self.rollout.fault_tolerance,
            "rejoins a restarted engine through the weight group, which rollout.lora_sync=adapter does not use",
            f"set rollout.fault_tolerance=false {fix}",
        )  # fmt: skip
        _require(
            not self.rollout.partial_rollouts, "rollout.partial_rollouts", self.rollout.partial_rollouts,
            "loads weights into the running AsyncLLM engine, which does not serve LoRA adapters here",
            f"set rollout.partial_rollouts=false {fix}",
        )  # fmt: skip

    def _validate_lora(self, *, num_experts: int | None) -> None:
        """The adapters' cross-section rules; ``num_experts`` None: before the model's config is read."""
        lora = self.model.lora
        _require(
            lora.enabled or self.rollout.lora_sync == "merged", "rollout.lora_sync", self.rollout.lora_sync,
            "sends adapters, but model.lora.rank is null (full fine-tuning)", "set rollout.lora_sync=merged",
        )  # fmt: skip
        if lora.enabled and self.rollout.lora_sync == "adapter":
            self._validate_adapter_sync()
        _require(
            lora.dropout == 0 or self.parallel.tp_size == 1, "model.lora.dropout", lora.dropout,
            f"needs the same dropout mask on every TP rank, which is not built (parallel.tp_size="
            f"{self.parallel.tp_size})", "set model.lora.dropout=0 or parallel.tp_size=1",
        )  # fmt: skip
        mlp = [name for name in lora.projections if name in MLP_PROJECTIONS]
        _require(
            not (lora.enabled and num_experts and mlp), "model.lora.target_modules", lora.target_modules,
            f"targets the MLP projections {mlp}, which are experts in {self.model.name_or_path} ({num_experts} a "
            "layer); adapters on experts are not built", "list the attention projections: [q_proj, k_proj, v_proj, "
            "o_proj]",
        )  # fmt: skip
