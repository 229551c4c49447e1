"""Per-token log-probabilities and entropy from (vocab-parallel) logits, without gathering the vocabulary.

docs/algorithm.md sections 1 and 4: the policy log-probs (with gradient) and the full-vocabulary Shannon entropy (nats)
come out of one pass over the logits. Under tensor parallelism each rank holds a contiguous vocabulary shard
(rank r owns global columns ``r*V/tp .. (r+1)*V/tp - 1``, Megatron's ``parallel_output=True`` layout); the softmax
statistics are combined with two all-reduces on ``tp_group``, issued through ``parallel.collectives.all_reduce_``
(the package's one collectives module, which imports torch only).

Dimension legend: P prompts, G group size, B = P*G sequences, T response tokens, S full sequence,
N flattened tokens, V padded vocabulary (Megatron output width), V/tp local vocabulary shard; internally the
logits are viewed as ``[O, I, V/tp]`` (O merged leading dims, I the second-to-last dim), never copied.

Math, per token, over the real vocabulary only (columns ``>= vocab_size`` are excluded), with log-prob
temperature T, entropy temperature T_H, global max ``M = max_k z_k`` and ``Z_T = sum_j exp((z_j - M) / T)``:
``logprob = (z_target - M) / T - log Z_T``; ``entropy = log Z_H - sum_j exp(s_j) s_j / Z_H`` with
``s_j = (z_j - M) / T_H``. Each rank first accumulates ``sum exp`` and ``sum exp * s`` relative to its own
per-token max ``m`` (one read of its shard, chunk by chunk, into two reused fp32 buffers), then re-bases them to
``M`` with ``delta = (m - M) / T_H``: ``sum exp(s) = e^delta * S_m`` and ``sum exp(s) s = e^delta * (D_m + delta *
S_m)`` (and ``Z_T`` likewise with ``(m - M) / T``).
Backward w.r.t. ``z_k`` (recomputed chunk by chunk from the saved logits and the saved ``M``, ``log Z``, ``H``):
``g_lp * (1[k = target] - p_k) / T - g_H * q_k * (log q_k + H) / T_H`` with ``p`` the softmax at T, ``q`` at T_H.

Masked tokens: a ``-inf`` logit is a token of probability exactly 0 (it adds nothing to ``Z`` or to the entropy,
whose ``0 * log 0`` terms are 0, and gets gradient 0). A shard whose row is all ``-inf`` (every token of this rank
masked) contributes nothing. A row whose real vocabulary is ALL ``-inf``, or holds ``+inf`` or NaN, has no
softmax: it is refused (``ValueError`` naming the row; see ``check_inputs``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from gtpo_megatron.parallel.collectives import all_reduce_

_LOG_P_FLOOR = -1.0e4
"""Floor for ``log p`` in the entropy gradient: every fp32 ``exp`` below about -104 is exactly 0, so flooring
changes no product ``p * log p`` and turns ``0 * (-inf)`` (a ``-inf`` logit) into 0."""


@dataclass(frozen=True)
class _OpSettings:
    """Plain settings of one call (see :func:`vocab_parallel_logprobs_entropy` for their meaning)."""

    vocab_start: int
    valid_width: int
    vocab_size: int
    temperature: float
    entropy_temperature: float
    chunk_size: int | None
    check_inputs: bool
    batch_shape: tuple[int, ...]

    @property
    def separate_entropy(self) -> bool:
        """The entropy needs its own normaliser (a temperature other than the log-probs')."""
        return self.entropy_temperature != self.temperature


def _tp_size_rank(tp_group) -> tuple[int, int]:
    if tp_group is None:
        return 1, 0
    return dist.get_world_size(tp_group), dist.get_rank(tp_group)


def _chunks(outer: int, inner: int, chunk_size: int | None) -> list[tuple[int, int, int, int]]:
    """``(o, a, b, f)``: rows ``a:b`` of leading index ``o`` of ``[O, I, V]`` logits are flat tokens ``f:f+b-a``."""
    step = max(inner if chunk_size is None else chunk_size, 1)
    return [(o, a, min(a + step, inner), o * inner + a) for o in range(outer) for a in range(0, inner, step)]


def _work_buffers(inner: int, chunk_size: int | None, width: int, device, count: int) -> list[torch.Tensor]:
    """``count`` fp32 ``[chunk, V_valid]`` buffers that every chunk reuses (the op's whole fp32 working set)."""
    rows = inner if chunk_size is None else min(chunk_size, inner)
    return [torch.empty((rows, width), dtype=torch.float32, device=device) for _ in range(count)]


def _scaled_exp(shifted: torch.Tensor, temperature: float, out: torch.Tensor) -> torch.Tensor:
    """``out = exp(shifted / temperature)``."""
    if temperature == 1.0:
        return torch.exp(shifted, out=out)
    return torch.div(shifted, temperature, out=out).exp_()


def _local_statistics(local: torch.Tensor, settings: _OpSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass over the ``[O, I, V_valid]`` local shard.

    Returns ``(max_N, sums_kN)``: the per-token local max ``m`` (``-inf`` for a row all ``-inf`` here, ``+inf``
    for a row holding ``+inf`` or NaN) and, relative to it, ``sum exp(s_H)``, ``sum exp(s_H) s_H`` with
    ``s_H = (z - m) / T_H`` and, for a separate entropy temperature, ``sum exp((z - m) / T)``; fp32.
    """
    outer, inner, width = local.shape
    num_sums = 3 if settings.separate_entropy else 2
    max_N = torch.empty(outer * inner, dtype=torch.float32, device=local.device)
    sums_kN = torch.empty((num_sums, outer * inner), dtype=torch.float32, device=local.device)
    shifted_buf, exp_buf = _work_buffers(inner, settings.chunk_size, width, local.device, 2)
    for o, a, b, f in _chunks(outer, inner, settings.chunk_size):
        rows, flat = local[o, a:b], slice(f, f + b - a)
        shifted, exp = shifted_buf[: b - a], exp_buf[: b - a]
        max_N[flat] = rows.amax(dim=-1)
        base = torch.where(max_N[flat] > float("-inf"), max_N[flat], 0.0)  # all -inf here: keep -inf, not NaN
        torch.sub(rows, base.unsqueeze(-1), out=shifted)  # z - m, promoted to fp32
        _scaled_exp(shifted, settings.entropy_temperature, exp)
        torch.sum(exp, dim=-1, out=sums_kN[0, flat])
        # -inf logits give exp * s = 0 * (-inf) = NaN, the only NaN possible here (NaN/+inf rows are refused)
        torch.nansum(exp.mul_(shifted), dim=-1, out=sums_kN[1, flat])  # (a batched GEMV is 5x slower on CPU)
        if num_sums == 3:
            torch.sum(_scaled_exp(shifted, settings.temperature, exp), dim=-1, out=sums_kN[2, flat])
    sums_kN[1] /= settings.entropy_temperature
    return torch.where(max_N.isnan(), float("inf"), max_N), sums_kN


def _refuse_bad_rows(max_N, local_max_N, target_ids, settings: _OpSettings) -> bool:
    """The op's single host sync: target ids in range and a finite global max for every row, else ValueError.

    Returns whether some row of this shard is all ``-inf`` (its local softmax is undefined, see ``_grad_chunk``).
    """
    bad_rows_N = ~torch.isfinite(max_N)
    bad_ids_N = (target_ids < 0) | (target_ids >= settings.vocab_size)
    flags = torch.stack([bad_rows_N.any(), bad_ids_N.any(), (local_max_N == float("-inf")).any()])
    any_bad_row, any_bad_id, any_empty_shard_row = flags.tolist()
    if any_bad_id:
        raise ValueError(
            f"target_ids contain ids outside [0, vocab_size={settings.vocab_size}) e.g. "
            f"{target_ids[bad_ids_N][:4].tolist()}; padded-vocabulary columns are never targets: map "
            "padding to a real id and mask it out"
        )
    if not any_bad_row:
        return any_empty_shard_row
    flat = int(bad_rows_N.nonzero()[0])
    row = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), settings.batch_shape))
    where = f"logits row {row} (of target_ids shape {settings.batch_shape})"
    if float(max_N[flat]) == float("-inf"):
        raise ValueError(
            f"{where} is -inf in all {settings.vocab_size} real vocabulary columns: every token is "
            "masked, so the row has no softmax; leave at least one token unmasked, or drop that "
            "position from the batch before computing log-probs"
        )
    raise ValueError(
        f"{where} holds +inf or NaN in its real vocabulary columns (< vocab_size="
        f"{settings.vocab_size}): the log-softmax is undefined; check the model output for overflow "
        "(e.g. fp16 logits) or a NaN activation"
    )


def _global_statistics(local, target_ids, local_ids, in_shard, tp_group, settings: _OpSettings):
    """Global max ``M`` ``[N]``, the all-reduced fp32 ``[k, N]`` statistics and the shard's share of ``Z_T``.

    Rows: ``Z_T``, the target's ``(z_target - M) / T``, ``sum exp(s_H) s_H``, and ``Z_H`` (only with a separate
    entropy temperature). The share ``[N]`` (this shard's part of ``Z_T``; 1 at TP=1) is None when a shard row may
    be all ``-inf`` (only known through ``check_inputs``' sync at TP > 1): its local softmax is undefined.
    """
    num_tokens, device = target_ids.numel(), local.device
    num_sums = 3 if settings.separate_entropy else 2
    if settings.valid_width > 0 and num_tokens > 0:
        local_max_N, sums_kN = _local_statistics(local, settings)
    else:  # this rank's shard is all vocabulary padding: no probability mass
        local_max_N = torch.full((num_tokens,), float("-inf"), dtype=torch.float32, device=device)
        sums_kN = torch.zeros((num_sums, num_tokens), dtype=torch.float32, device=device)
    max_N = local_max_N.clone()
    all_reduce_(max_N, op="max", group=tp_group)
    empty_shard_rows = tp_group is not None
    if settings.check_inputs:
        empty_shard_rows &= _refuse_bad_rows(max_N, local_max_N, target_ids, settings)
    # Re-base from the local max m to the global max M; a shard row with no mass (m = -inf, sums 0) is based at
    # M so that delta = 0 instead of -inf (whose products with the zero sums would be NaN).
    base_N = torch.where(local_max_N > float("-inf"), local_max_N, max_N)
    stats_kN = torch.zeros((num_sums + 1, num_tokens), dtype=torch.float32, device=device)
    delta_h = (base_N - max_N) / settings.entropy_temperature
    scale_h = torch.exp(delta_h)
    stats_kN[2] = scale_h * (sums_kN[1] + delta_h * sums_kN[0])
    stats_kN[3 if num_sums == 3 else 0] = scale_h * sums_kN[0]
    if num_sums == 3:
        stats_kN[0] = torch.exp((base_N - max_N) / settings.temperature) * sums_kN[2]
    if settings.valid_width > 0:
        target_cols = local_ids.clamp(0, settings.valid_width - 1).view(local.shape[:2] + (1,))
        picked = local.gather(2, target_cols).view(-1).float()
        stats_kN[1] = torch.where(in_shard, (picked - max_N) / settings.temperature, 0.0)
    local_z_N = stats_kN[0].clone()
    all_reduce_(stats_kN, op="sum", group=tp_group)
    return max_N, stats_kN, (None if empty_shard_rows else local_z_N / stats_kN[0])


def _logprob_grad_chunk(logits, out, max_N, log_z, g_lp, temperature) -> None:
    """``out = -p * g_lp / T`` with ``p = exp((z - M) / T) / Z`` (the target's ``+g_lp / T`` is added later)."""
    torch.sub(logits, max_N.unsqueeze(-1), out=out)
    if temperature != 1.0:
        out.div_(temperature)
    out.exp_()
    out.mul_((-g_lp / temperature * torch.exp(-log_z)).unsqueeze(-1))


def _softmax_grad_chunk(logits, out, scratch, share_N, g_lp, temperature) -> None:
    """``out = -p * g_lp / T`` as :func:`_logprob_grad_chunk`, with ``p = share * softmax(z / T)`` over the shard.

    One fused row-wise kernel instead of three element-wise passes; ``scratch`` holds ``z / T`` unless the logits
    are contiguous fp32 at ``T = 1`` (``out`` must be contiguous). The softmax re-sums ``Z`` of the shard, equal to
    the forward's up to fp32 rounding.
    """
    source = logits
    if logits.dtype != torch.float32 or not logits.is_contiguous():
        source = scratch.copy_(logits)  # fp32 first: a 16-bit tensor divided by a number stays 16-bit
        if temperature != 1.0:
            source.div_(temperature)
    elif temperature != 1.0:
        source = torch.div(logits, temperature, out=scratch)
    torch.softmax(source, dim=-1, out=out)
    out.mul_((-g_lp / temperature * share_N).unsqueeze(-1))


def _full_grad_chunk(logits, out, logp, max_N, log_z, entropy, g_lp, g_h, temperature) -> None:
    """``out = -p * (g_lp + g_H * (log p + H)) / T``, using ``logp`` as scratch (``g_lp`` may be 0.0)."""
    torch.sub(logits, max_N.unsqueeze(-1), out=logp)
    if temperature != 1.0:
        logp.div_(temperature)
    logp.sub_(log_z.unsqueeze(-1))
    torch.exp(logp, out=out)
    logp.clamp_(min=_LOG_P_FLOOR)  # -inf logits: p = 0 and log p = -inf; 0 * finite instead of 0 * inf
    slope = (g_h / temperature).unsqueeze(-1)
    intercept = ((g_lp + g_h * entropy) / temperature).unsqueeze(-1)
    out.mul_(logp.mul_(slope).add_(intercept)).neg_()


def _grad_chunk(rows, out, scratch, saved, g_lp, g_h, settings: _OpSettings) -> None:
    """Gradient of one chunk except the target column's ``+g_lp / T`` (see the module docstring)."""
    max_N, log_z, log_z_h, entropy, share_N = saved
    if g_h is None and share_N is not None:  # the softmax path (contiguous ``out``: see the backward)
        _softmax_grad_chunk(rows, out, scratch, share_N, g_lp, settings.temperature)
    elif g_h is None:
        _logprob_grad_chunk(rows, out, max_N, log_z, g_lp, settings.temperature)
    elif not settings.separate_entropy:
        _full_grad_chunk(rows, out, scratch, max_N, log_z, entropy, g_lp, g_h, settings.temperature)
    else:  # entropy part at T_H, then the log-prob part at T through the (then free) scratch buffer
        _full_grad_chunk(rows, out, scratch, max_N, log_z_h, entropy, 0.0, g_h, settings.entropy_temperature)
        _logprob_grad_chunk(rows, scratch, max_N, log_z, g_lp, settings.temperature)
        out.add_(scratch)


class _LogprobsEntropy(torch.autograd.Function):
    """Autograd function over ``[O, I, V/tp]`` logits (flat token index ``o * I + i``).

    See :func:`vocab_parallel_logprobs_entropy`.
    """

    @staticmethod
    def forward(ctx, logits, target_ids, tp_group, settings: _OpSettings, entropy_requires_grad: bool):
        local = logits[..., : settings.valid_width]
        local_ids = target_ids - settings.vocab_start
        in_shard = (local_ids >= 0) & (local_ids < settings.valid_width)
        max_N, stats_kN, share_N = _global_statistics(local, target_ids, local_ids, in_shard, tp_group, settings)
        z_h = stats_kN[3] if settings.separate_entropy else stats_kN[0]
        log_z, log_z_h = torch.log(stats_kN[0]), torch.log(z_h)
        logprobs = stats_kN[1] - log_z
        entropy = log_z_h - stats_kN[2] / z_h
        ctx.save_for_backward(logits, local_ids, in_shard, max_N, log_z, log_z_h, entropy, share_N)
        ctx.settings = settings
        ctx.set_materialize_grads(False)
        if not entropy_requires_grad:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, local_ids, in_shard, *saved = ctx.saved_tensors
        settings: _OpSettings = ctx.settings
        width, temperature = settings.valid_width, settings.temperature
        outer, inner, _ = logits.shape
        grad_logits = torch.empty_like(logits)
        grad_logits[..., width:] = 0  # padded-vocabulary columns
        if width == 0 or local_ids.numel() == 0 or (grad_logprobs is None and grad_entropy is None):
            grad_logits[..., :width] = 0
            return grad_logits, None, None, None, None
        g_lp = torch.zeros_like(saved[1]) if grad_logprobs is None else grad_logprobs.float()
        g_h = None if grad_entropy is None else grad_entropy.float()
        target_cols = local_ids.clamp(0, width - 1).unsqueeze(-1)
        target_grad = torch.where(in_shard, g_lp / temperature, 0.0).unsqueeze(-1)
        in_place = logits.dtype == torch.float32  # fp32: build the gradient directly in the output rows
        softmax_path = g_h is None and saved[-1] is not None and (not in_place or grad_logits.stride(-2) == width)
        rows_ready = in_place and temperature == 1.0 and logits.stride(-1) == 1 and logits.stride(-2) == width
        needs_scratch = g_h is not None or (softmax_path and not rows_ready)  # _softmax_grad_chunk's z/T
        saved[-1] = saved[-1] if softmax_path else None
        num_buffers = (0 if in_place else 1) + int(needs_scratch)
        buffers = _work_buffers(inner, settings.chunk_size, width, logits.device, num_buffers)
        for o, a, b, f in _chunks(outer, inner, settings.chunk_size):
            flat = slice(f, f + b - a)
            out = grad_logits[o, a:b, :width] if in_place else buffers[-1][: b - a]
            scratch = buffers[0][: b - a] if needs_scratch else None
            _grad_chunk(
                logits[o, a:b, :width],
                out,
                scratch,
                [None if t is None else t[flat] for t in saved],
                g_lp[flat],
                None if g_h is None else g_h[flat],
                settings,
            )
            out.scatter_add_(1, target_cols[flat], target_grad[flat])
            if not in_place:
                grad_logits[o, a:b, :width].copy_(out)
        return grad_logits, None, None, None, None


def _validate(logits, target_ids, tp_size, vocab_size, padded_vocab_size, temperatures, chunk_size) -> int:
    local_width = logits.shape[-1]
    full_width = local_width * tp_size
    if padded_vocab_size is not None and padded_vocab_size != full_width:
        raise ValueError(
            f"logits.shape[-1]={local_width} * tp_size={tp_size} = {full_width} != padded_vocab_size="
            f"{padded_vocab_size}; pass the local vocabulary shard and the matching tp_group"
        )
    vocab = full_width if vocab_size is None else vocab_size
    if not 1 <= vocab <= full_width:
        raise ValueError(f"vocab_size={vocab_size} must be in [1, {full_width}] (local width {local_width} * tp)")
    if tuple(target_ids.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"target_ids shape {tuple(target_ids.shape)} must equal logits.shape[:-1] {tuple(logits.shape[:-1])}"
        )
    if target_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"target_ids must be int64 (or int32) global token ids; got {target_ids.dtype}")
    for name, value in temperatures.items():
        if not value > 0:
            raise ValueError(f"{name}={value} must be > 0")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be a positive token count or None")
    return vocab


def vocab_parallel_logprobs_entropy(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    entropy_temperature: float | None = None,
    chunk_size: int | None = None,
    with_entropy: bool = True,
    entropy_requires_grad: bool = False,
    padded_vocab_size: int | None = None,
    check_inputs: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities of ``target_ids`` and full-vocabulary entropy from a vocabulary shard.

    Args:
        logits: ``[..., V/tp]`` this rank's vocabulary shard, any float dtype; not modified or copied (a
            non-contiguous view such as ``logits[:, :-1]`` is processed sequence by sequence). ``-inf`` marks a
            masked token; padded columns (``>= vocab_size``) may hold anything.
        target_ids: ``[...]`` int64 ids in the *global* vocabulary, in ``[0, vocab_size)``.
        tp_group: the group sharding the vocabulary; ``None``: ``logits`` holds all V columns.
        vocab_size: real vocabulary (default V); padded columns get no mass, no entropy and zero gradient.
        temperature: log-probs of ``softmax(logits / temperature)``.
        entropy_temperature: the entropy's temperature (``None``: the same; else three more passes per chunk).
        chunk_size: tokens per chunk (fp32 working set: two ``[chunk_size, V/tp]`` buffers; ``None``: one chunk).
        with_entropy: return the entropy.
        entropy_requires_grad: make the entropy differentiable (else detached).
        padded_vocab_size: optional V to validate ``logits.shape[-1] * tp_size == V``.
        check_inputs: refuse bad ids and rows without a softmax at ONE host sync per call (identical on every TP
            rank, so all raise together); ``False``: no sync, such rows give NaN.

    Returns:
        ``(logprobs, entropy)``, ``[...]`` fp32 nats: logprobs differentiable w.r.t. ``logits`` (a target whose own
        logit is ``-inf`` gets ``-inf`` with a finite gradient); entropy, or None.

    Collectives:
        Forward: a MAX all-reduce of ``[N]`` row maxima and a SUM of a ``[3, N]`` stack (``[4, N]`` with a
        separate ``entropy_temperature``) on ``tp_group``; none in backward.

    Raises:
        ValueError: a shard width inconsistent with ``padded_vocab_size``, ``vocab_size`` out of range, shape or
            dtype mismatches, a temperature ``<= 0``, ``chunk_size < 1``; with ``check_inputs``: ids outside
            ``[0, vocab_size)``, a row all ``-inf`` or holding ``+inf``/NaN (naming the row).
    """
    if entropy_temperature is None or not with_entropy:
        entropy_temperature = temperature
    tp_size, tp_rank = _tp_size_rank(tp_group)
    vocab = _validate(
        logits,
        target_ids,
        tp_size,
        vocab_size,
        padded_vocab_size,
        {"temperature": temperature, "entropy_temperature": entropy_temperature},
        chunk_size,
    )
    local_width = logits.shape[-1]
    vocab_start = tp_rank * local_width
    batch_shape = tuple(target_ids.shape)
    settings = _OpSettings(
        vocab_start=vocab_start,
        valid_width=max(0, min(local_width, vocab - vocab_start)),
        vocab_size=vocab,
        temperature=float(temperature),
        entropy_temperature=float(entropy_temperature),
        chunk_size=chunk_size,
        check_inputs=check_inputs,
        batch_shape=batch_shape,
    )
    if logits.dim() <= 2 or logits.is_contiguous():
        logits_OIV = logits.reshape(1, -1, local_width)  # a view: one flat run of tokens
    else:  # e.g. logits[:, :-1] of [B, S, V/tp]: chunk within each sequence instead of copying the logits
        logits_OIV = logits.flatten(0, -3)
    logprobs, entropy = _LogprobsEntropy.apply(
        logits_OIV, target_ids.reshape(-1).long(), tp_group, settings, with_entropy and entropy_requires_grad
    )
    logprobs = logprobs.view(batch_shape)
    return logprobs, (entropy.view(batch_shape) if with_entropy else None)
