"""The config sections: frozen dataclasses that check their own fields, and the root ``GTPOConfig``.

Each section is a frozen ``kw_only`` slotted dataclass that checks its own fields in ``__post_init__``;
``GTPOConfig.validate(world_size)`` does the cross-section arithmetic once the world size is known. Components receive
their section, never the root. Reading YAML is ``config/loader.py``'s job (this module does not import it).

Every error is a ``ValueError`` that names the field, shows the value, states the rule and proposes a fix.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from typing import Literal

from gtpo_megatron.builtin_models import local_model_folder
from gtpo_megatron.plan import engines, layout
from gtpo_megatron.plan.architectures import architecture_from_hf_config

LN2 = math.log(2.0)


def _require(ok: bool, name: str, value: object, rule: str, fix: str) -> None:
    """Raise ``ValueError("name=value: rule; fix")`` unless ``ok``."""
    if not ok:
        raise ValueError(f"{name}={value!r}: {rule}; {fix}")


def _require_numbers(section: object, prefix: str) -> None:
    """Refuse a non-number in an ``int`` or ``float`` field (e.g. a symbolic ``"max_tokens/5"`` from Python)."""
    for spec in fields(section):
        value = getattr(section, spec.name)
        number = isinstance(value, int | float) and not isinstance(value, bool)
        optional = spec.type.endswith("| None") and value is None
        if spec.type.split(" |")[0] in ("int", "float") and not (number or optional):
            _require(False, f"{prefix}.{spec.name}", value, f"must be a number ({spec.type})",
                     "give the number itself (config.preset_values(name, max_tokens=N) for a preset)")  # fmt: skip


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """The model to train and how Megatron holds it (``model.*``)."""

    name_or_path: str
    """Local HF folder, hub name (online users) or ``builtin:smollm2-135m-instruct|tiny-llama|tiny-qwen2``."""
    params_dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    """Dtype of the Megatron parameters (the optimizer keeps fp32 master weights for 16-bit types)."""
    make_vocab_size_divisible_by: int = 128
    """Megatron pads the vocabulary to a multiple of this times tp_size (padded_vocab_size)."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recompute granularity passed to Megatron."""
    pad_attention_heads: bool = False
    """Pad the KV groups (zero weights, exact: they stay zero in training) up to a multiple of ``parallel.tp_size``
    when they do not divide it, e.g. SmolLM2-135M's 3 groups x 3 heads at TP=2 (see
    ``megatron_adapter/head_padding.py``). Export and weight sync strip the padding."""
    megatron_overrides: dict[str, object] = field(default_factory=dict)
    """Extra ``TransformerConfig`` fields (checked against Megatron's dataclass in ``GTPOConfig.validate``); the
    fields a section or the HF config sets are refused (``megatron_adapter.settings.OWNED_FIELDS``)."""
    megatron_checkpoint: str | None = None
    """A Megatron-LM / Megatron-Bridge checkpoint (``torch_dist`` format: the root holding
    ``latest_checkpointed_iteration.txt``, or one ``iter_NNNNNNN`` folder) whose model weights are the starting
    policy, loaded at any TP/PP layout; weights only (no optimizer state, RNG or iteration count). ``name_or_path``
    then supplies the HF config and tokenizer only (its folder needs no weights); the vLLM engine starts with
    dummy weights and receives these by a weight push before the first rollout. null: start from
    ``name_or_path``'s weights."""
    fp32_output_layer: bool = True
    """Compute the logits in fp32 when the parameters are bf16/fp16: the output layer multiplies fp32 casts of its
    16-bit input and weight (``megatron_adapter/output_layer.py``), so the log-probs and entropies the loss, the
    filter and the train/rollout mismatch read are not rounded to 16 bits first (up to ~4e-3 nats otherwise). Costs
    fp32 logits and their gradient on the last pipeline stage (``gtpo-plan`` counts it). No effect with fp32
    parameters."""

    def __post_init__(self) -> None:
        _require(
            bool(self.name_or_path),
            "model.name_or_path",
            self.name_or_path,
            "must not be empty",
            "give a local HF folder or builtin:smollm2-135m-instruct",
        )
        _require(
            self.make_vocab_size_divisible_by >= 1,
            "model.make_vocab_size_divisible_by",
            self.make_vocab_size_divisible_by,
            "must be >= 1",
            "use 128 (Megatron's default)",
        )
        _require(
            self.megatron_checkpoint is None or (bool(self.megatron_checkpoint) and not self.pad_attention_heads),
            "model.megatron_checkpoint/model.pad_attention_heads",
            (self.megatron_checkpoint, self.pad_attention_heads),
            "a Megatron checkpoint is loaded as written (unpadded heads) and must not be empty",
            "set model.pad_attention_heads=false and give the checkpoint folder, or model.megatron_checkpoint=null",
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelConfig:
    """Training parallelism and the distributed backend (``parallel.*``)."""

    tp_size: int = 1
    """Tensor-parallel size (shards heads, MLP and vocabulary)."""
    pp_size: int = 1
    """Pipeline-parallel size (shards layers)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs tp_size > 1): activations outside the tensor-parallel regions are split
    over the TP ranks along the sequence; with Megatron's local layer specs the norms are
    ``megatron_adapter.model.SequenceParallelRMSNorm``."""
    use_distributed_optimizer: bool = False
    """Shard optimizer states over data-parallel ranks (Megatron distributed optimizer)."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """torch.distributed backend; ``auto`` is ``cpu:gloo,cuda:nccl`` with CUDA (NCCL for CUDA tensors, gloo for CPU
    tensors and objects; ``parallel.groups.CUDA_BACKEND``) and gloo otherwise; ``nccl`` is NCCL alone."""

    def __post_init__(self) -> None:
        for name in ("tp_size", "pp_size"):
            _require(getattr(self, name) >= 1, f"parallel.{name}", getattr(self, name), "must be >= 1", "use 1")
        _require(
            not self.sequence_parallel or self.tp_size > 1,
            "parallel.sequence_parallel",
            self.sequence_parallel,
            "needs parallel.tp_size > 1",
            "set parallel.sequence_parallel=false",
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutConfig:
    """Sampling and the vLLM engine (``rollout.*``; GTPO_SPEC section 6 for the paper's values)."""

    placement: Literal["colocated", "separate"] = "colocated"
    """``colocated``: the engine shares the training devices and sleeps while the policy trains; ``separate``: the
    engine runs on devices of its own (outside the torchrun world) and never sleeps."""
    num_prompts: int = 1
    """Prompts P per step (the paper uses 1); B = P * group_size sequences."""
    temperature: float = 0.9
    """Sampling temperature (GTPO_SPEC section 6: 0.9)."""
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
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """vLLM weight dtype; ``auto`` follows model.params_dtype."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory vLLM may take (colocated runs share it with training)."""
    cpu_kv_cache_gib: float = 1.0
    """KV-cache size on CPU (VLLM_CPU_KVCACHE_SPACE, GiB)."""
    weight_sync_bucket_mb: int = 512
    """Bound on the weight bytes in flight during a sync, per process (MiB): one bucket on the ``files`` path, two
    pipelined buckets of half this size on the ``collective`` path (``rollout/weight_wire.py``)."""
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
    weight_sync: Literal["collective", "files"] = "collective"
    """How new weights reach the engines after each step: ``collective`` broadcasts bucketed tensors from global
    rank 0 to every engine worker over a process group of their own (gloo on CPU, NCCL on GPU), each worker
    loading them in one reload pass; ``files`` stages safetensors shards in ``/dev/shm`` for one engine (fallback,
    ``num_engines`` must be 1)."""
    timeout_s: float = 1800.0
    """Seconds an engine may take to generate one round or to apply one weight update before the job stops with an
    error naming the engine and its ranks (also the weight group's collective timeout)."""

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
        self._check_engines()

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
        _require(
            self.weight_sync == "collective" or self.num_engines in ("auto", 1),
            "rollout.weight_sync",
            self.weight_sync,
            f"the files path feeds one engine, not rollout.num_engines={self.num_engines}",
            "use rollout.weight_sync=collective or rollout.num_engines=1",
        )
        _require(self.timeout_s > 0, "rollout.timeout_s", self.timeout_s, "must be > 0 seconds", "use 1800")


@dataclass(frozen=True, kw_only=True, slots=True)
class AlgorithmConfig:
    """The policy-optimisation algorithm: GTPO and its GRPO/DAPO/Dr. GRPO presets (``algorithm.*``)."""

    name: Literal["gtpo", "grpo", "dapo", "dr_grpo"] = "gtpo"
    """Policy loss and preset (GTPO_SPEC sections 1-5); unset fields take the preset of this name."""
    group_size: int = 8
    """Completions G per prompt (paper: 8 or 12)."""
    advantage_estimator: str = "group_mean"
    """Registered estimator: ``group_mean`` (GTPO, section 2) or ``group_mean_std`` (GRPO)."""
    conflict_mode: Literal["prefix_suffix", "any_position", "off"] = "prefix_suffix"
    """Conflict-token rule of section 3; ``off`` gives lambda = 1 on every response token."""
    conflict_amplification: float = 2.0
    """lambda on positive conflict tokens (w, section 3)."""
    conflict_overlap: Literal["once", "multiply"] = "once"
    """A token in both prefix and suffix runs gets w once, or w*w (authors' code parity switch)."""
    normalize_by_conflicts: bool = False
    """Divide completion i by max(1, n_i) as the authors' code does (section 3 parity switch)."""
    entropy_filter: Literal["off", "paper", "fixed"] = "paper"
    """Entropy filter delta_i (section 4), with tau = ``entropy_threshold`` (NOT always ln 2: ln 2 is only its
    default): ``paper`` measures <H>_ini, the mean <H>_i of the completions of the first ``initial_entropy_steps``
    steps, keeps every completion when <H>_ini > tau and otherwise drops those with <H>_i > tau; ``fixed`` always
    drops <H>_i > tau; ``off`` keeps all. Ties (<H>_i == tau) are kept. A resumed run keeps the <H>_ini of its
    checkpoint and refuses to measure it on a trained policy."""
    entropy_threshold: float = LN2
    """tau in nats, used by both the ``paper`` and the ``fixed`` filter: ln 2 by default (the paper's rule); the
    authors' code uses 0.7 for Llama-3.1-8B."""
    entropy_only_negative: bool = False
    """Filter only completions with A_i < 0 (paper ablation GTPO-OnlyNeg)."""
    entropy_penalty: float = 0.1
    """gamma in A_i - gamma * <H>_i (section 4; paper ablates 0.1 .. 1e-6); 0 disables."""
    entropy_temperature: float = 1.0
    """Temperature of the entropy <H>_i (section 4: 1 by default, or the sampling temperature)."""
    skip_uniform_groups: bool = False
    """Drop groups whose rewards are all equal instead of giving them the small -gamma*<H> update."""
    exclude_filtered_from_conflicts: bool = False
    """Compute conflicts only among completions the entropy filter keeps (section 4 switch)."""
    aggregation: Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum"] = "seq-mean-token-mean"
    """Token aggregation of the loss; the normaliser is global over the optimizer step (section 1)."""
    clip_eps_low: float = 0.2
    """Lower PPO clip epsilon (ratio >= 1 - eps_low)."""
    clip_eps_high: float = 0.2
    """Upper PPO clip epsilon (DAPO clip-higher: 0.28)."""
    kl_coef: float = 0.0
    """beta of the optional KL term to a frozen reference policy, a copy of the initial weights under the same
    layout (GRPO and Dr. GRPO only, GTPO_SPEC section 5; the paper's GRPO runs use 0 or 1e-6). Logged as
    ``train/kl_mean`` (mean per response token)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator when kl_coef > 0 (Schulman's k1, k2, k3; ``ops.losses.PolicyLossFn``)."""
    num_updates_per_batch: int = 1
    """Optimizer steps per rollout batch (paper: 1, so the ratio is 1 with gradient)."""
    dynamic_sampling: bool = False
    """DAPO: drop groups with equal rewards and sample more prompts until the batch is full (section 5)."""
    dynamic_sampling_max_rounds: int = 4
    """Rollout rounds per step before dynamic sampling trains on what it has."""
    overlong_buffer_len: int = 0
    """DAPO overlong shaping L_cache: linear penalty over the last L_cache tokens before max_tokens; 0 = off."""
    overlong_penalty: float = 1.0
    """Penalty of the overlong shaping at max_tokens (reached linearly over the buffer), as a fraction of the reward
    function's range (``rewards.reward_span``: 1 for the 0/1 rewards, 20 for the paper's 0-20 reward): 1.0 is DAPO's
    penalty of 1 on a 0/1 reward, i.e. 20 on the paper reward."""
    overlong_filter: bool = False
    """DAPO overlong filtering: truncated completions (finish_reason=length) get zero token weight."""
    logprob_chunk_size: int | None = None
    """Tokens per chunk in the vocab-parallel log-prob/entropy op (None = unchunked)."""
    conflict_sign: Literal["raw", "penalized"] = "raw"
    """Which advantage's sign splits a group into P+ and P- for the conflict weights lambda (section 3): ``raw``,
    A_i (the spec and the authors' code); ``penalized``, A_i - gamma <H>_i, the advantage the loss multiplies (a
    completion whose small positive A_i turns negative after the penalty is then not amplified). Example: G=8,
    rewards [1.5]*7 + [1], every <H>_i = 0.7: A_0 = +0.0625 but A_0 - 0.1 * 0.7 = -0.0075; ``raw`` amplifies
    row 0's shared tokens (lambda 2) under a negative update, ``penalized`` finds no P+ and no conflicts. Needs the
    entropies before the update: one extra no-grad forward pass per step when gamma > 0."""
    loss_temperature: Literal["sampling", 1.0] = "sampling"
    """Softmax temperature of the log-probs in the loss (and the ratio and the KL term): ``sampling``, the rollout
    temperature, so pi_theta is the distribution the completions were drawn from (the default); ``1.0``, the raw
    logits as in the authors' code. The train/rollout mismatch metrics need ``sampling`` (vLLM's log-probs are at
    the sampling temperature) and are not reported with ``1.0``."""
    initial_entropy_steps: int = 1
    """Steps whose completions are averaged into <H>_ini of the ``paper`` filter (GTPO_SPEC section 4: 1, the first
    step). With 1 prompt per step (the paper recipes) one step is one question's G samples; more steps pool more
    questions, each measured under the policy of its step (before its update), and the filter uses the running
    mean meanwhile. Each of these steps runs one no-grad forward pass before its update."""
    kl_reference_offload: bool = False
    """With kl_coef > 0 on CUDA: keep the reference policy's weights in host memory between its forward passes
    (one host-to-device copy per step; ``gtpo-plan`` then counts no reference weights on the GPU). No effect on
    CPU."""

    def __post_init__(self) -> None:
        _require_numbers(self, "algorithm")
        _require(
            self.group_size >= 2,
            "algorithm.group_size",
            self.group_size,
            "must be >= 2 (group-relative advantages are 0 for a group of one)",
            "use 8 (paper) or 4",
        )
        _require(
            self.conflict_amplification >= 1,
            "algorithm.conflict_amplification",
            self.conflict_amplification,
            "must be >= 1",
            "use 2.0 (GTPO_SPEC section 3)",
        )
        _require(
            self.entropy_threshold > 0,
            "algorithm.entropy_threshold",
            self.entropy_threshold,
            "must be > 0",
            "use ln 2 = 0.693 or 0.7",
        )
        _require(
            self.entropy_penalty >= 0,
            "algorithm.entropy_penalty",
            self.entropy_penalty,
            "must be >= 0",
            "use 0.1 (GTPO_SPEC section 4) or 0",
        )
        _require(
            self.entropy_temperature > 0,
            "algorithm.entropy_temperature",
            self.entropy_temperature,
            "must be > 0",
            "use 1.0",
        )
        _require(
            0 <= self.clip_eps_low <= self.clip_eps_high,
            "algorithm.clip_eps_low/clip_eps_high",
            (self.clip_eps_low, self.clip_eps_high),
            "need 0 <= clip_eps_low <= clip_eps_high",
            "use 0.2/0.2 (GRPO) or 0.2/0.28 (DAPO)",
        )
        _require(self.kl_coef >= 0, "algorithm.kl_coef", self.kl_coef, "must be >= 0", "use 0 or 1e-6 (paper GRPO)")
        _require(
            self.kl_coef == 0 or self.name in ("grpo", "dr_grpo"),
            "algorithm.kl_coef",
            self.kl_coef,
            f"the {self.name} objective has no KL term (GTPO_SPEC sections 1 and 5: no reference model)",
            "set algorithm.kl_coef=0, or algorithm=grpo for GRPO with a KL term",
        )
        required = {"dapo": "token-mean", "dr_grpo": "seq-mean-token-sum"}.get(self.name)
        _require(
            required is None or self.aggregation == required,
            "algorithm.aggregation",
            self.aggregation,
            f"the {self.name} loss is defined with aggregation {required!r} (GTPO_SPEC section 5)",
            f"set algorithm.aggregation={required} or drop the override",
        )
        for name in ("num_updates_per_batch", "dynamic_sampling_max_rounds"):
            _require(getattr(self, name) >= 1, f"algorithm.{name}", getattr(self, name), "must be >= 1", "use 1")
        _require(
            self.overlong_buffer_len >= 0,
            "algorithm.overlong_buffer_len",
            self.overlong_buffer_len,
            "must be >= 0",
            "use 0 (off)",
        )
        _require(
            not isinstance(self.loss_temperature, bool) and self.loss_temperature in ("sampling", 1.0),
            "algorithm.loss_temperature",
            self.loss_temperature,
            "must be 'sampling' or 1.0",
            "use sampling (default) or 1.0 (authors' code)",
        )
        _require(
            self.initial_entropy_steps >= 1,
            "algorithm.initial_entropy_steps",
            self.initial_entropy_steps,
            "must be >= 1",
            "use 1 (GTPO_SPEC section 4: the first step)",
        )
        _require(
            self.logprob_chunk_size is None or self.logprob_chunk_size >= 1,
            "algorithm.logprob_chunk_size",
            self.logprob_chunk_size,
            "must be >= 1 or null",
            "use null or 4096",
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimConfig:
    """Adam, the learning-rate schedule and micro-batching (``optim.*``)."""

    lr: float = 1e-6
    """Peak AdamW learning rate (section 6: 1e-6)."""
    min_lr: float = 0.0
    """Learning rate at the end of the cosine decay over trainer.max_steps (== lr for a constant schedule)."""
    warmup_steps: int = 0
    """Linear warm-up steps."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    clip_grad: float = 0.1
    """Global gradient-norm clip (section 6: 0.1); 0 disables."""
    micro_batch_size: int = 1
    """Sequences per micro-batch on each data-parallel rank."""

    def __post_init__(self) -> None:
        _require(self.lr > 0, "optim.lr", self.lr, "must be > 0", "use 1e-6 (paper)")
        _require(
            0 <= self.min_lr <= self.lr, "optim.min_lr", self.min_lr, "must be in [0, optim.lr]", "use 0 or optim.lr"
        )
        _require(self.warmup_steps >= 0, "optim.warmup_steps", self.warmup_steps, "must be >= 0", "use 0")
        for name in ("adam_beta1", "adam_beta2"):
            _require(
                0 <= getattr(self, name) < 1,
                f"optim.{name}",
                getattr(self, name),
                "must be in [0, 1)",
                "use 0.9 / 0.999",
            )
        _require(self.clip_grad >= 0, "optim.clip_grad", self.clip_grad, "must be >= 0", "use 0.1 (paper)")
        _require(self.micro_batch_size >= 1, "optim.micro_batch_size", self.micro_batch_size, "must be >= 1", "use 1")


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
    (GTPO_SPEC section 6: think step by step inside <reasoning>...</reasoning>, final answer inside
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
    """On SIGTERM (preemption; SIGKILL follows ~30 s later) abort the step in flight at its next safe point, save
    the last completed step and exit cleanly (``gtpo_megatron.preemption``)."""
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

    def validate(self, world_size: int, *, check_registries: bool = True) -> None:
        """Cross-section checks once the world size is known.

        The planner's rules (``plan.layout``, ``plan.engines``): tp*pp divides the world size, P*G splits over dp
        and the per-rank share into micro-batches, an explicit ``rollout.num_engines`` tiles the world (colocated)
        or the engine GPUs (separate), and, when the model's config.json is local, tp divides the attention heads and
        KV heads (unless ``model.pad_attention_heads``) and pp the layers. Then prompt + completion fit the model's
        ``max_position_embeddings``, ``megatron_overrides`` keys are fields of Megatron's ``TransformerConfig`` and,
        with ``check_registries``, the advantage estimator and reward names are registered (imports torch,
        megatron and the rewards).

        Raises:
            ValueError: naming the fields, the values, the rule and a fix (every layout problem at once).
        """
        tp, pp = self.parallel.tp_size, self.parallel.pp_size
        dp = max(world_size // (tp * pp), 1)
        problems = layout.world_problems(
            world_size,
            tp_size=tp,
            pp_size=pp,
            described=f"the world size {world_size}",
            launch=f"a multiple of {tp * pp} ranks",
        )
        problems += layout.batch_problems(
            num_prompts=self.rollout.num_prompts,
            group_size=self.algorithm.group_size,
            dp_size=dp,
            micro_batch_size=self.optim.micro_batch_size,
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
        hf = read_hf_config(self.model.name_or_path)
        if hf is not None:
            arch = architecture_from_hf_config(hf, name=self.model.name_or_path)
            problems += layout.model_problems(
                arch, tp_size=tp, pp_size=pp, pad_attention_heads=self.model.pad_attention_heads
            )
        layout.raise_problems(problems)
        if hf is not None:
            self._validate_sequence_length(hf.get("max_position_embeddings"))
        if check_registries:
            self._validate_registries()

    def _validate_sequence_length(self, max_pos: int | None) -> None:
        total = self.rollout.max_prompt_len + self.rollout.max_tokens
        _require(
            max_pos is None or total <= max_pos,
            "rollout.max_prompt_len+rollout.max_tokens",
            total,
            f"must not exceed the model's max_position_embeddings={max_pos}",
            "shorten prompts or completions",
        )

    def _validate_registries(self) -> None:
        from megatron.core.transformer import TransformerConfig

        known = {f.name for f in fields(TransformerConfig)}
        for key in self.model.megatron_overrides:
            _require(
                key in known,
                "model.megatron_overrides",
                key,
                "is not a field of megatron TransformerConfig",
                f"use one of its fields, e.g. {sorted(known)[:5]}",
            )
        from gtpo_megatron.ops import advantages
        from gtpo_megatron.rewards import registry

        advantages.get_advantage_estimator(self.algorithm.advantage_estimator)
        registry.get_reward(self.reward.name)


def read_hf_config(name_or_path: str) -> dict | None:
    """The model's ``config.json`` as a dict when it is on local disk (built-ins: once materialised), else None."""
    path = local_model_folder(name_or_path) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else None
