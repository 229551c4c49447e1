"""The ``rollout``, ``data`` and ``reward`` sections: what vLLM samples, from which problems, scored how."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gtpo_megatron.config.checks import require as _require
from gtpo_megatron.config.weight_sync import choose_weight_sync
from gtpo_megatron.plan.engines import Placement

EngineDtype = Literal["auto", "float32", "bfloat16", "float16"]
"""The engines' weight dtypes (``rollout.dtype``, ``gtpo-eval --dtype``); ``auto``: the trainer's."""

ENGINE_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM (0.32) accepts; ``rollout.lora_sync: adapter`` takes the smallest >= the rank."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutConfig:
    """Sampling and the vLLM engine (``rollout.*``; docs/algorithm.md section 6 for the paper's values)."""

    placement: Placement = "colocated"
    """``colocated``: the engine shares the training devices and sleeps while the policy trains; ``separate``: the
    engine runs on devices of its own (outside the torchrun world) and never sleeps."""
    mode: Literal["sync", "async"] = "sync"
    """``sync``: each step samples with the newest weights, then trains, then syncs; ``async`` (``placement:
    separate``): the engines sample the batches of the next steps while the policy trains, each batch with the
    weights of ``max_staleness`` steps before the step that trains on it (docs/training.md, "Asynchronous
    rollouts"; pair it with ``algorithm.off_policy_correction``)."""
    max_staleness: int = 1
    """``async`` only: policy versions between a batch's weights and the policy it trains (1: one-step-off)."""
    partial_rollouts: bool = False
    """``async`` with ``placement: separate`` only: a weight update lands in the middle of the engines' requests
    (paused keeping their KV cache, loaded through any ``weight_sync`` path, resumed:
    ``rollout/vllm_async_engine.py``), with one engine or many, with ``fault_tolerance`` too; each token records
    the policy version that sampled it, and tokens more than ``max_staleness`` versions old leave the loss
    (docs/algorithm.md section 11, "Mixed versions")."""
    num_prompts: int = 1
    """Prompts P per step (the paper uses 1); B = P * group_size sequences."""
    temperature: float = 0.9
    """Sampling temperature (docs/algorithm.md section 6: 0.9)."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]."""
    max_tokens: int = 1500
    """Maximum completion length L_max in tokens (section 6: 1500)."""
    max_prompt_len: int = 512
    """Prompts longer than this many tokens are skipped by the data loader."""
    stop: tuple[str, ...] = ()
    """Extra stop strings (EOS always stops)."""
    seed: int = 0
    """Base sampling seed. Rollout round r of step s (r > 0 only with dynamic sampling) samples with
    ``seed + 1000 * s + r``, and sample j of the prompt at global index i of that round with
    ``rollout.engine.request_seed(seed + 1000 * s + r, i, j)`` (no two (prompt, sample) pairs share a random
    stream); it is also the engine's own seed. A resumed run therefore samples exactly
    as the original run did, given the same weights."""
    engine_tp_size: int = 1
    """vLLM tensor-parallel size."""
    dtype: EngineDtype = "auto"
    """vLLM weight dtype; ``auto`` follows model.params_dtype."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory vLLM may take (colocated runs share it with training)."""
    cpu_kv_cache_gib: float = 1.0
    """KV-cache size on CPU (VLLM_CPU_KVCACHE_SPACE, GiB)."""
    weight_sync_bucket_mb: int = 512
    """Bound on the weight bytes in flight during a sync, per process (MiB): one bucket on the ``files`` path, two
    pipelined buckets of half this size on the ``collective`` and ``sharded`` paths (``rollout/weight_wire.py``,
    ``rollout/sharded_wire.py``)."""
    offload_train_state: bool = False
    """Colocated runs on GPU: free the gradient buffers and move the optimizer states (fp32 main weights and Adam
    moments) to host memory while vLLM generates, then bring them back (megatron-core's
    ``DistributedDataParallel.offload_grad_buffers`` and ``MegatronOptimizer.offload_to_cpu``, made for RL). Costs
    two host<->device copies of the optimizer state per step; ``gtpo-plan`` counts only the weights as resident
    during rollout when set. Requires ``placement: colocated``; has no effect (a warning says so) on CPU."""
    num_engines: int | Literal["auto"] = "auto"
    """vLLM engines sharing each step's prompts (whole groups, balanced; ``plan/engines.py``). ``auto``: with GPUs,
    one engine per ``engine_tp_size`` GPUs of the world (colocated) or of ``num_engine_gpus`` (separate); on CPU
    one engine. ``num_engines * engine_tp_size`` must divide the world size (colocated) or the engine GPUs."""
    num_engine_gpus: int | None = None
    """``placement: separate`` only: GPUs the engines take outside the training world, spread evenly over the
    nodes (null: ``engine_tp_size``, one engine)."""
    weight_sync: Literal["auto", "collective", "sharded", "files"] = "auto"
    """How new weights reach the engines after each step. ``auto`` (resolved at start-up, logged once) takes
    ``sharded`` wherever it applies, else ``collective``; what rules each path
    out is ``config/weight_sync.py``'s. ``collective`` broadcasts bucketed tensors from global rank 0 to every engine
    worker over a process group of their own (gloo on CPU, NCCL on GPU), each worker loading them in one reload
    pass; ``sharded`` has every training rank send the pieces it holds straight to every worker (at
    ``engine_tp_size`` > 1 only its slice), many senders at once and no gather (gloo, CPU engines only;
    docs/scaling.md); ``files`` stages safetensors shards in ``/dev/shm`` for one engine (``num_engines`` 1)."""
    lora_sync: Literal["merged", "adapter"] = "merged"
    """With ``model.lora``: ``merged`` sends the weights with the adapters folded in (``W + alpha / rank * B @ A``)
    through the ``weight_sync`` path, so any engine serves them; ``adapter`` starts the engines with LoRA enabled
    (the base weights loaded once from the HF folder, never moved) and each sync writes only the adapters as a PEFT
    folder in node-local staging that every engine serves under a new LoRA id (``rollout/adapter_sync.py``)."""
    routing_replay: Literal["off", "rollout"] = "off"
    """Mixture-of-experts policies: ``rollout`` replays the engine's expert choices in the training forwards (rollout
    routing replay, R3, arXiv 2510.11370; docs/moe.md): each token goes to the experts vLLM routed it to, weighted by
    the trainer's router over those experts; ``off``: the trainer's router chooses its own top-k."""
    timeout_s: float = 1800.0
    """Seconds an engine may take to generate one round or to apply one weight update before the job stops with an
    error naming the engine and its ranks on every rank (also the weight group's collective timeout; the world
    group's is ``GTPOConfig.world_timeout_s``, which covers ``max_staleness`` of them in async mode)."""
    fault_tolerance: bool = False
    """Keep training when an engine dies or stops answering (``rollout/fault_tolerance.py``, docs/training.md,
    "Engine failures"): its prompts move to the surviving engines with the same request seeds, it restarts in the
    background and rejoins with the current weights at a weight sync (sync or async mode). Needs
    ``rollout.num_engines >= 2`` and ``weight_sync: collective`` (or ``auto``). Off: a failed engine stops the job,
    naming it."""
    health_check_interval_s: float = 10.0
    """Fault tolerance: seconds between two health checks of an engine that is generating or receiving weights."""
    health_check_timeout_s: float = 5.0
    """Fault tolerance: seconds a health check may take before the engine counts as hung (<= ``timeout_s``)."""
    health_check_first_wait_s: float = 300.0
    """Fault tolerance: seconds after an engine's (re)start during which a slow health check is tolerated (a cold
    start compiles); a dead process counts at once."""
    max_restarts: int = 3
    """Fault tolerance: restarts allowed per engine over the run; the next failure of that engine stops the job."""

    def __post_init__(self) -> None:
        _require(self.num_prompts >= 1, "rollout.num_prompts", self.num_prompts, "must be >= 1", "use 1 or more")
        _require(self.temperature > 0, "rollout.temperature", self.temperature, "must be > 0", "use 0.9 (paper) or 1.0")
        _require(0 < self.top_p <= 1, "rollout.top_p", self.top_p, "must be in (0, 1]", "use 1.0")
        _require(self.max_tokens >= 1, "rollout.max_tokens", self.max_tokens, "must be >= 1", "use e.g. 1500")
        _require(
            self.max_prompt_len >= 1, "rollout.max_prompt_len", self.max_prompt_len, "must be >= 1", "use e.g. 512"
        )
        _require(self.engine_tp_size >= 1, "rollout.engine_tp_size", self.engine_tp_size, "must be >= 1", "use 1")
        _require(
            0 < self.gpu_memory_utilization <= 1,
            "rollout.gpu_memory_utilization",
            self.gpu_memory_utilization,
            "must be in (0, 1]",
            "use 0.5 when colocated",
        )
        _require(self.cpu_kv_cache_gib > 0, "rollout.cpu_kv_cache_gib", self.cpu_kv_cache_gib, "must be > 0", "use 1")
        _require(
            self.weight_sync_bucket_mb >= 1,
            "rollout.weight_sync_bucket_mb",
            self.weight_sync_bucket_mb,
            "must be >= 1",
            "use 512",
        )
        _require(
            not self.offload_train_state or self.placement == "colocated",
            "rollout.offload_train_state/rollout.placement",
            (self.offload_train_state, self.placement),
            "offloading the training state only frees memory for an engine on the same devices (colocated)",
            "set rollout.offload_train_state=false, or rollout.placement=colocated",
        )
        _require(
            self.mode == "sync" or self.placement == "separate",
            "rollout.mode/rollout.placement",
            (self.mode, self.placement),
            "async rollouts generate while the policy trains, so the engines need devices of their own",
            "set rollout.placement=separate (with rollout.num_engine_gpus on GPU), or rollout.mode=sync",
        )
        _require(
            self.max_staleness >= 1,
            "rollout.max_staleness",
            self.max_staleness,
            "must be >= 1 (the policy versions a batch's weights lag behind; rollout.mode=sync is staleness 0)",
            "use 1 (one-step-off), or rollout.mode=sync",
        )
        self._check_partial_rollouts()
        self._check_engines()
        choose_weight_sync(self)  # the paths these settings leave (config/weight_sync.py)

    def _check_partial_rollouts(self) -> None:
        """In-flight weight updates need async mode, engines of their own and no routed-experts capture."""
        if not self.partial_rollouts:
            return
        _require(
            self.mode == "async" and self.placement == "separate",
            "rollout.partial_rollouts/rollout.mode/rollout.placement",
            (self.partial_rollouts, self.mode, self.placement),
            "in-flight weight updates land while the engines generate, which only async mode with engines on "
            "devices of their own does",
            "set rollout.mode=async and rollout.placement=separate, or rollout.partial_rollouts=false",
        )
        _require(
            self.routing_replay == "off",
            "rollout.partial_rollouts/rollout.routing_replay",
            (self.partial_rollouts, self.routing_replay),
            "a completion sampled by two policy versions has no single routing to replay",
            "set rollout.routing_replay=off, or rollout.partial_rollouts=false",
        )

    def _check_engines(self) -> None:
        _require(
            self.num_engines == "auto" or self.num_engines >= 1,
            "rollout.num_engines",
            self.num_engines,
            "must be >= 1 or auto",
            "use auto",
        )
        _require(
            self.num_engine_gpus is None
            or (
                self.placement == "separate"
                and self.num_engine_gpus >= self.engine_tp_size
                and self.num_engine_gpus % self.engine_tp_size == 0
            ),
            "rollout.num_engine_gpus",
            self.num_engine_gpus,
            f"needs rollout.placement=separate and a multiple of rollout.engine_tp_size={self.engine_tp_size}",
            "set it to k * engine_tp_size with placement=separate, or null",
        )
        _require(self.timeout_s > 0, "rollout.timeout_s", self.timeout_s, "must be > 0 seconds", "use 1800")
        self._check_fault_tolerance()

    def _check_fault_tolerance(self) -> None:
        _require(self.health_check_interval_s > 0, "rollout.health_check_interval_s", self.health_check_interval_s,
                 "must be > 0 seconds", "use 10")  # fmt: skip
        _require(self.health_check_timeout_s > 0, "rollout.health_check_timeout_s", self.health_check_timeout_s,
                 "must be > 0 seconds", "use 5")  # fmt: skip
        _require(self.health_check_first_wait_s >= 0, "rollout.health_check_first_wait_s",
                 self.health_check_first_wait_s, "must be >= 0 seconds", "use 300 (a cold start compiles)")  # fmt: skip
        _require(self.max_restarts >= 0, "rollout.max_restarts", self.max_restarts,
                 "must be >= 0 (restarts per engine over the run)", "use 3")  # fmt: skip
        if not self.fault_tolerance:
            return
        _require(
            self.health_check_timeout_s <= self.timeout_s,
            "rollout.health_check_timeout_s",
            self.health_check_timeout_s,
            f"must be <= rollout.timeout_s={self.timeout_s:g} seconds (a check slower than the step's own bound "
            "never decides anything)",
            "use 5",
        )
        _require(
            self.num_engines == "auto" or self.num_engines >= 2,
            "rollout.fault_tolerance/rollout.num_engines",
            (self.fault_tolerance, self.num_engines),
            "fault tolerance continues a step on the surviving engines; one engine leaves none (a restart-and-wait "
            "costs what a resume from the last checkpoint costs, without its guarantees)",
            "set rollout.num_engines >= 2, or rollout.fault_tolerance=false",
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    """The problem set and its order (``data.*``)."""

    source: str = "synthetic"
    """``gsm8k|math500|aime24|aime25|amc23|math|synthetic`` or a Hugging Face dataset name."""
    path: str | None = None
    """jsonl file; None uses the source's file in the data folder (``$GTPO_DATA_DIR``, see ``gtpo-data``) or the
    Hugging Face dataset."""
    split: str = "train"
    """Split for HF datasets and the default files."""
    limit: int | None = None
    """Use only the first ``limit`` problems (None = all)."""
    shuffle_seed: int = 0
    """Seed of the epoch order (a resumed run continues the same order) and of the synthetic generator."""
    synthetic_difficulty: Literal["easy", "medium", "hard"] = "easy"
    """Level of the built-in arithmetic word problems (``gtpo_megatron.data.synthetic.SYNTHETIC_LEVELS``)."""
    system_prompt: Literal["authors", "concise"] = "concise"
    """The system message of every prompt (``data.prompts.SYSTEM_PROMPTS``): ``authors``, the paper's instruction
    (docs/algorithm.md section 6: think step by step inside <reasoning>...</reasoning>, final answer inside
    <answer>...</answer>, nothing more), used by the paper recipes; ``concise``, this repository's stricter text
    that also spells out the format template (answer only, no units), used by the CPU demo."""

    def __post_init__(self) -> None:
        _require(bool(self.source), "data.source", self.source, "must not be empty", "use synthetic or gsm8k")
        _require(
            self.limit is None or self.limit >= 1,
            "data.limit",
            self.limit,
            "must be >= 1 or null",
            "use null for all problems",
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class RewardConfig:
    """The reward function and its worker pool (``reward.*``)."""

    name: str = "paper"
    """Registered reward function (the paper's format+correctness scheme, section 6, or a binary math reward)."""
    num_workers: int = 2
    """Worker processes that score answers."""
    timeout_s: float = 5.0
    """Seconds per answer; a timeout or a crash scores 0 and is counted (``reward/num_timeouts``,
    ``reward/num_errors``)."""
    extraction: Literal["strict", "lenient"] | None = None
    """How an answer is found in a completion (``rewards.answer_text``): ``strict`` needs ``\\boxed{}``,
    ``<answer>``, ``####`` or a "final answer is" statement (MATH, AIME, AMC); ``lenient`` also takes the last
    number or expression (GSM8K). ``null`` follows ``data.source`` (``rewards.default_extraction``: lenient for
    gsm8k and synthetic, strict otherwise)."""
    max_error_frac: float = 0.5
    """Stop the run when more than this fraction of one scoring round's answers time out or fail in the grader
    (``rewards.check_grader_failures``); in (0, 1]."""

    def __post_init__(self) -> None:
        _require(self.num_workers >= 1, "reward.num_workers", self.num_workers, "must be >= 1", "use 2")
        _require(self.timeout_s > 0, "reward.timeout_s", self.timeout_s, "must be > 0", "use 5")
        _require(
            0 < self.max_error_frac <= 1, "reward.max_error_frac", self.max_error_frac, "must be in (0, 1]", "use 0.5"
        )
