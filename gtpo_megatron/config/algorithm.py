"""The ``algorithm`` section: GTPO and its baselines (docs/algorithm.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from gtpo_megatron.choices import (
    KL_LOSSES,
    OFF_POLICY_CAP_MIN,
    REQUIRED_AGGREGATION,
    Aggregation,
    ConflictMode,
    ConflictOverlap,
    EntropyFilterMode,
    KlEstimator,
    LossName,
    OffPolicyCorrection,
)
from gtpo_megatron.config.checks import require as _require
from gtpo_megatron.config.checks import require_numbers

LN2 = math.log(2.0)


@dataclass(frozen=True, kw_only=True, slots=True)
class AlgorithmConfig:
    """The policy-optimisation algorithm: GTPO and its GRPO/DAPO/Dr. GRPO presets (``algorithm.*``)."""

    name: LossName = "gtpo"
    """Policy loss and preset (docs/algorithm.md sections 1-5); unset fields take the preset of this name."""
    group_size: int = 8
    """Completions G per prompt (paper: 8 or 12)."""
    advantage_estimator: str = "group_mean"
    """Registered estimator: ``group_mean`` (GTPO, section 2) or ``group_mean_std`` (GRPO)."""
    conflict_mode: Literal[ConflictMode, "off"] = "prefix_suffix"
    """Conflict-token rule of section 3; ``off`` gives lambda = 1 on every response token."""
    conflict_amplification: float = 2.0
    """lambda on positive conflict tokens (w, section 3)."""
    conflict_overlap: ConflictOverlap = "once"
    """A token in both prefix and suffix runs gets w once, or w*w (authors' code parity switch)."""
    normalize_by_conflicts: bool = False
    """Divide completion i by max(1, n_i) as the authors' code does (section 3 parity switch)."""
    entropy_filter: EntropyFilterMode = "paper"
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
    aggregation: Aggregation = "seq-mean-token-mean"
    """Token aggregation of the loss; the normaliser is global over the optimizer step (section 1)."""
    clip_eps_low: float = 0.2
    """Lower PPO clip epsilon (ratio >= 1 - eps_low)."""
    clip_eps_high: float = 0.2
    """Upper PPO clip epsilon (DAPO clip-higher: 0.28)."""
    kl_coef: float = 0.0
    """beta of the optional KL term to a frozen reference policy, a copy of the initial weights under the same
    layout (GRPO and Dr. GRPO only, docs/algorithm.md section 5; the paper's GRPO runs use 0 or 1e-6). Logged as
    ``train/kl_mean`` (mean per response token)."""
    kl_estimator: KlEstimator = "k3"
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
    """Steps whose completions are averaged into <H>_ini of the ``paper`` filter (docs/algorithm.md section 4: 1, the
    first step). With 1 prompt per step (the paper recipes) one step is one question's G samples; more steps pool more
    questions, each measured under the policy of its step (before its update), and the filter uses the running
    mean meanwhile. Each of these steps runs one no-grad forward pass before its update."""
    off_policy_correction: OffPolicyCorrection = "none"
    """Importance weight of each token's surrogate for completions sampled by an older policy or a mismatched engine
    (docs/algorithm.md section 11, decoupled PPO): ``none``; ``tis``, truncated IS, w = min(pi_prox / mu, C);
    ``mis``, masked IS, w = pi_prox / mu on tokens with pi_prox / mu <= C and 0 above. mu is the engine's log-prob of
    the sampled token, so it needs ``loss_temperature: sampling``. Logged as ``offpolicy/is_weight_mean`` and
    ``offpolicy/is_capped_frac``."""
    off_policy_cap: float = 2.0
    """The cap C of ``off_policy_correction`` (>= 1, ``choices.OFF_POLICY_CAP_MIN``; 2 is the value verl and slime
    default to)."""
    kl_reference_offload: bool = False
    """With kl_coef > 0 on CUDA: keep the reference policy's weights in host memory between its forward passes
    (one host-to-device copy per step; ``gtpo-plan`` then counts no reference weights on the GPU). No effect on
    CPU."""

    def __post_init__(self) -> None:
        require_numbers(self, "algorithm")
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
            "use 2.0 (docs/algorithm.md section 3)",
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
            "use 0.1 (docs/algorithm.md section 4) or 0",
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
            self.kl_coef == 0 or self.name in KL_LOSSES,
            "algorithm.kl_coef",
            self.kl_coef,
            f"the {self.name} objective has no KL term (docs/algorithm.md sections 1 and 5: no reference model)",
            "set algorithm.kl_coef=0, or algorithm=grpo for GRPO with a KL term",
        )
        required = REQUIRED_AGGREGATION.get(self.name)
        _require(
            required is None or self.aggregation == required,
            "algorithm.aggregation",
            self.aggregation,
            f"the {self.name} loss is defined with aggregation {required!r} (docs/algorithm.md section 5)",
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
            "use 1 (docs/algorithm.md section 4: the first step)",
        )
        _require(
            self.off_policy_cap >= OFF_POLICY_CAP_MIN,
            "algorithm.off_policy_cap",
            self.off_policy_cap,
            f"must be >= {OFF_POLICY_CAP_MIN} (a cap below it truncates tokens the engine and the trainer agree on)",
            "use 2.0",
        )
        _require(
            self.off_policy_correction == "none" or self.loss_temperature == "sampling",
            "algorithm.off_policy_correction/loss_temperature",
            (self.off_policy_correction, self.loss_temperature),
            "the behaviour log-probs are the engine's at the sampling temperature; the ratio needs the loss's there",
            "set algorithm.loss_temperature=sampling or algorithm.off_policy_correction=none",
        )
        _require(
            self.logprob_chunk_size is None or self.logprob_chunk_size >= 1,
            "algorithm.logprob_chunk_size",
            self.logprob_chunk_size,
            "must be >= 1 or null",
            "use null or 4096",
        )
