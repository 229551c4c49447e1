"""Step time of sync and async rollouts for a split of the GPUs between training and engines (``gtpo-plan``).

A first-order model to choose a split with, not a prediction. N parameters (a mixture of experts: the active
ones, ``Architecture.active_params``; the weight reads W count every expert), B sequences of at most S = prompt +
completion tokens per step, L completion tokens, G_t training and G_e engine GPUs, e = ``rollout.engine_tp_size``:

    t_train = 6 N B S / (G_t * peak * mfu)                  forward + backward of every token of the step
    t_gen   = L * max((W + b C K) / (e * bw), 2 N b / (e * peak * mfu))   per decode step an engine reads its
              weights W (bytes) and the KV cache of its b = B / engines sequences (mean context C = prompt + L / 2,
              K bytes per token), and computes their next tokens
    sync:   t_gen + t_train + t_sync   (colocated: every GPU does both in turn, G_t = G_e = G)
    async:  max(t_gen, t_train + t_sync)   (separate, ``rollout.mode: async``: generation overlaps training)

A batch ends with its longest completion, so L is ``rollout.max_tokens``. Partial rollouts stream the requests of
the k + 1 queued batches (k = ``rollout.max_staleness``): a slot freed by a short completion takes the next request,
so a step costs its B * Lbar tokens (Lbar the mean completion) at (k + 1) times the concurrency: Lbar / (k + 1)
decode steps of (k + 1) b sequences at mean context prompt + Lbar / 2 (``StepWork.mean_completion_tokens``).

Decoding is bound by memory reads, so more engines shorten t_gen only through the KV share (b) and the weight
reads not at all; the split that minimises the async step is what :func:`best_split` suggests.
Prefill and the reward are left out (small against L decode steps of long completions). Pure arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

from gtpo_megatron.plan.architectures import Architecture


@dataclass(frozen=True, kw_only=True, slots=True)
class Hardware:
    """One GPU: ``peak_tflops`` dense bf16, ``hbm_tbps`` memory bandwidth, ``mfu`` the fraction of peak reached."""

    peak_tflops: float
    hbm_tbps: float
    mfu: float


@dataclass(frozen=True, kw_only=True, slots=True)
class StepWork:
    """One step's work: B ``sequences`` of S ``seq_length`` tokens, L ``completion_tokens``, e ``engine_tp_size``.

    ``weight_bytes`` W: the engine's weights; ``kv_bytes_per_token`` K: one token's KV cache (over all its GPUs).
    Partial rollouts: ``mean_completion_tokens`` Lbar and ``batches_in_flight`` k + 1 (module docstring); None: L.
    """

    sequences: int
    seq_length: int
    completion_tokens: int
    weight_bytes: int
    kv_bytes_per_token: int
    engine_tp_size: int
    mean_completion_tokens: float | None = None
    batches_in_flight: int = 1


@dataclass(frozen=True, kw_only=True, slots=True)
class StepTime:
    """Seconds of one step's phases on ``train_gpus`` + ``engine_gpus`` GPUs; ``step_s`` per its mode."""

    train_gpus: int
    engine_gpus: int
    generate_s: float
    train_s: float
    sync_s: float
    overlapped: bool

    @property
    def step_s(self) -> float:
        """``max(generate, train + sync)`` when overlapped, else their sum."""
        if self.overlapped:
            return max(self.generate_s, self.train_s + self.sync_s)
        return self.generate_s + self.train_s + self.sync_s


def train_seconds(arch: Architecture, work: StepWork, hw: Hardware, *, gpus: int) -> float:
    """``6 N B S / (G_t peak mfu)``: the step's forward and backward on ``gpus`` training GPUs."""
    flops = 6 * arch.active_params() * work.sequences * work.seq_length
    return flops / (gpus * hw.peak_tflops * 1e12 * hw.mfu)


def generate_seconds(arch: Architecture, work: StepWork, hw: Hardware, *, gpus: int) -> float:
    """``L * max((W + b C K) / (e bw), 2 N b / (e peak mfu))`` with ``gpus // e`` engines (at most one a sequence).

    Partial rollouts (``work.mean_completion_tokens``): Lbar / (k + 1) decode steps of (k + 1) b sequences.
    """
    engines = max(min(gpus // work.engine_tp_size, work.sequences), 1)
    mean = work.mean_completion_tokens
    decoded, in_flight = (work.completion_tokens, 1) if mean is None else (mean, work.batches_in_flight)
    per_engine = -(-work.sequences * in_flight // engines)
    context = work.seq_length - work.completion_tokens + decoded / 2
    read_bytes = work.weight_bytes + per_engine * context * work.kv_bytes_per_token
    read_s = read_bytes / (work.engine_tp_size * hw.hbm_tbps * 1e12)
    compute_s = 2 * arch.active_params() * per_engine / (work.engine_tp_size * hw.peak_tflops * 1e12 * hw.mfu)
    return decoded / in_flight * max(read_s, compute_s)


def sync_step(arch: Architecture, work: StepWork, hw: Hardware, *, gpus: int, sync_s: float) -> StepTime:
    """The colocated sync step on ``gpus`` GPUs (generation, then training, then the weight sync)."""
    return _step_time(arch, work, hw, train_gpus=gpus, engine_gpus=gpus, sync_s=sync_s, overlapped=False)


def _step_time(
    arch: Architecture, work: StepWork, hw: Hardware, *, train_gpus: int, engine_gpus: int, sync_s: float,
    overlapped: bool,
) -> StepTime:  # fmt: skip
    """The modelled phases of a step with ``train_gpus`` training and ``engine_gpus`` generating GPUs."""
    return StepTime(
        train_gpus=train_gpus,
        engine_gpus=engine_gpus,
        generate_s=generate_seconds(arch, work, hw, gpus=engine_gpus),
        train_s=train_seconds(arch, work, hw, gpus=train_gpus),
        sync_s=sync_s,
        overlapped=overlapped,
    )


def best_split(
    arch: Architecture, work: StepWork, hw: Hardware, *, gpus: int, train_multiple: int, sync_s: float
) -> StepTime | None:
    """The async split of ``gpus`` with the shortest step; None when no split leaves both sides a GPU.

    ``train_multiple``: the training GPUs must be a multiple of it (``tp * pp``, times what makes dp divide B);
    the engine GPUs a multiple of ``engine_tp_size``.
    """
    best = None
    for train_gpus in range(train_multiple, gpus, train_multiple):
        engine_gpus = gpus - train_gpus
        if engine_gpus % work.engine_tp_size or work.sequences % (train_gpus // train_multiple):
            continue
        candidate = _step_time(
            arch, work, hw, train_gpus=train_gpus, engine_gpus=engine_gpus, sync_s=sync_s, overlapped=True
        )
        if best is None or candidate.step_s < best.step_s:
            best = candidate
    return best
