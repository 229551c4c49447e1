"""Per-token log-probabilities and entropy from (vocab-parallel) logits, without gathering the vocabulary.

GTPO_SPEC sections 1 and 4: the policy log-probs (with gradient) and the full-vocabulary Shannon entropy (nats)
come out of one pass over the logits. Under tensor parallelism each rank holds a contiguous vocabulary shard
(rank r owns global columns ``r*V/tp .. (r+1)*V/tp - 1``, Megatron's ``parallel_output=True`` layout); the softmax
statistics are combined with two all-reduces on ``tp_group``.

Dimension legend: P prompts, G group size, B = P*G sequences, T response tokens, S full sequence,
N flattened tokens, V padded vocabulary (Megatron output width), V/tp local vocabulary shard; internally the
logits are viewed as ``[O, I, V/tp]`` (O merged leading dims, I the second-to-last dim), never copied.

Math, per token, over the real vocabulary only (columns ``>= vocab_size`` are excluded), with temperature T,
global max ``M = max_k z_k`` and ``s_j = (z_j - M) / T``, ``Z = sum_j exp(s_j)``:
``logprob = s_target - log Z``; ``entropy = log Z - sum_j exp(s_j) s_j / Z``.
Each rank first accumulates ``sum exp`` and ``sum exp * s`` relative to its own per-token max ``m`` (one read of
its shard, chunk by chunk, into two reused fp32 buffers), then re-bases them to ``M`` with
``delta = (m - M) / T``: ``sum exp(s) = e^delta * S_m`` and ``sum exp(s) s = e^delta * (D_m + delta * S_m)``.
Backward w.r.t. ``z_k`` (recomputed chunk by chunk from the saved logits and the saved ``M``, ``log Z``, ``H``):
``(g_lp * (1[k = target] - p_k) - g_H * p_k * (log p_k + H)) / T``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _tp_size_rank(tp_group) -> tuple[int, int]:
    if tp_group is None:
        return 1, 0
    return dist.get_world_size(tp_group), dist.get_rank(tp_group)


def _all_reduce(tensor: torch.Tensor, op, tp_group) -> None:
    if tp_group is not None:
        dist.all_reduce(tensor, op=op, group=tp_group)


def _chunks(outer: int, inner: int, chunk_size: int | None) -> list[tuple[int, int, int, int]]:
    """``(o, a, b, f)``: rows ``a:b`` of leading index ``o`` of ``[O, I, V]`` logits are flat tokens ``f:f+b-a``."""
    step = max(inner if chunk_size is None else chunk_size, 1)
    return [(o, a, min(a + step, inner), o * inner + a) for o in range(outer) for a in range(0, inner, step)]


def _work_buffers(inner: int, chunk_size: int | None, width: int, device, count: int) -> list[torch.Tensor]:
    """``count`` fp32 ``[chunk, V_valid]`` buffers that every chunk reuses (the op's whole fp32 working set)."""
    rows = inner if chunk_size is None else min(chunk_size, inner)
    return [torch.empty((rows, width), dtype=torch.float32, device=device) for _ in range(count)]


def _local_statistics(local, temperature, chunk_size):
    """One pass over the ``[O, I, V_valid]`` local shard: per-token local max ``m`` and, relative to it,
    ``sum exp`` and ``sum exp*s`` with ``s = (z - m) / T``; each returned flat ``[N]`` fp32."""
    outer, inner, width = local.shape
    max_N, sum_exp_N, sum_exp_s_N = (torch.empty(outer * inner, dtype=torch.float32, device=local.device)
                                     for _ in range(3))
    shifted_buf, exp_buf = _work_buffers(inner, chunk_size, width, local.device, 2)
    for o, a, b, f in _chunks(outer, inner, chunk_size):
        rows, flat = local[o, a:b], slice(f, f + b - a)
        shifted, exp = shifted_buf[: b - a], exp_buf[: b - a]
        max_N[flat] = rows.amax(dim=-1)
        torch.sub(rows, max_N[flat].unsqueeze(-1), out=shifted)  # promotes to fp32
        if temperature != 1.0:
            shifted.div_(temperature)
        torch.exp(shifted, out=exp)
        torch.sum(exp, dim=-1, out=sum_exp_N[flat])
        torch.sum(shifted.mul_(exp), dim=-1, out=sum_exp_s_N[flat])  # (a batched GEMV here is 5x slower on CPU)
    return max_N, sum_exp_N, sum_exp_s_N


def _logprob_grad_chunk(logits, out, max_N, log_z, g_lp, temperature) -> None:
    """``out = -p * g_lp / T`` with ``p = exp((z - M) / T) / Z`` (the target's ``+g_lp / T`` is added later)."""
    torch.sub(logits, max_N.unsqueeze(-1), out=out)
    if temperature != 1.0:
        out.div_(temperature)
    out.exp_()
    out.mul_((-g_lp / temperature * torch.exp(-log_z)).unsqueeze(-1))


def _full_grad_chunk(logits, out, logp, max_N, log_z, entropy, g_lp, g_h, temperature) -> None:
    """``out = -p * (g_lp + g_H * (log p + H)) / T``, using ``logp`` as scratch."""
    torch.sub(logits, max_N.unsqueeze(-1), out=logp)
    if temperature != 1.0:
        logp.div_(temperature)
    logp.sub_(log_z.unsqueeze(-1))
    torch.exp(logp, out=out)
    slope = (g_h / temperature).unsqueeze(-1)
    intercept = ((g_lp + g_h * entropy) / temperature).unsqueeze(-1)
    out.mul_(logp.mul_(slope).add_(intercept)).neg_()


class _LogprobsEntropy(torch.autograd.Function):
    """Autograd function over ``[O, I, V/tp]`` logits (flat token index ``o * I + i``); see
    :func:`vocab_parallel_logprobs_entropy`."""

    @staticmethod
    def forward(ctx, logits, target_ids, tp_group, vocab_start, valid_width, temperature, chunk_size,
                entropy_requires_grad):
        num_tokens, device = target_ids.numel(), logits.device
        local = logits[..., :valid_width]
        local_ids = target_ids - vocab_start
        in_shard = (local_ids >= 0) & (local_ids < valid_width)
        stats_3N = torch.zeros((3, num_tokens), dtype=torch.float32, device=device)
        max_N = torch.full((num_tokens,), float("-inf"), dtype=torch.float32, device=device)
        if valid_width > 0 and num_tokens > 0:
            local_max_N, local_sum_exp_N, local_sum_exp_s_N = _local_statistics(local, temperature, chunk_size)
            max_N = local_max_N.clone()
            _all_reduce(max_N, dist.ReduceOp.MAX, tp_group)
            # Re-base the local sums from the local max to the global max M: s = s_local + delta.
            delta_N = (local_max_N - max_N) / temperature
            scale_N = torch.exp(delta_N)
            target_cols = local_ids.clamp(0, valid_width - 1).view(logits.shape[:2] + (1,))
            picked = local.gather(2, target_cols).view(-1).float()
            stats_3N[0] = local_sum_exp_N * scale_N
            stats_3N[1] = torch.where(in_shard, (picked - max_N) / temperature, 0.0)
            stats_3N[2] = scale_N * (local_sum_exp_s_N + delta_N * local_sum_exp_N)
        else:
            _all_reduce(max_N, dist.ReduceOp.MAX, tp_group)
        _all_reduce(stats_3N, dist.ReduceOp.SUM, tp_group)
        log_z = torch.log(stats_3N[0])
        logprobs = stats_3N[1] - log_z
        entropy = log_z - stats_3N[2] / stats_3N[0]
        ctx.save_for_backward(logits, local_ids, in_shard, max_N, log_z, entropy)
        ctx.config = (valid_width, temperature, chunk_size)
        ctx.set_materialize_grads(False)
        if not entropy_requires_grad:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, local_ids, in_shard, max_N, log_z, entropy = ctx.saved_tensors
        valid_width, temperature, chunk_size = ctx.config
        outer, inner, _ = logits.shape
        grad_logits = torch.empty_like(logits)
        grad_logits[..., valid_width:] = 0  # padded-vocabulary columns
        if valid_width == 0 or local_ids.numel() == 0 or (grad_logprobs is None and grad_entropy is None):
            grad_logits[..., :valid_width] = 0
            return (grad_logits,) + (None,) * 7
        g_lp = torch.zeros_like(log_z) if grad_logprobs is None else grad_logprobs.float()
        target_cols = local_ids.clamp(0, valid_width - 1).unsqueeze(-1)
        target_grad = torch.where(in_shard, g_lp / temperature, 0.0).unsqueeze(-1)
        in_place = logits.dtype == torch.float32  # fp32: build the gradient directly in the output rows
        num_buffers = (0 if in_place else 1) + (0 if grad_entropy is None else 1)
        buffers = _work_buffers(inner, chunk_size, valid_width, logits.device, num_buffers)
        for o, a, b, f in _chunks(outer, inner, chunk_size):
            rows, flat = logits[o, a:b, :valid_width], slice(f, f + b - a)
            out = grad_logits[o, a:b, :valid_width] if in_place else buffers[-1][: b - a]
            if grad_entropy is None:
                _logprob_grad_chunk(rows, out, max_N[flat], log_z[flat], g_lp[flat], temperature)
            else:
                _full_grad_chunk(rows, out, buffers[0][: b - a], max_N[flat], log_z[flat], entropy[flat],
                                 g_lp[flat], grad_entropy[flat].float(), temperature)
            out.scatter_add_(1, target_cols[flat], target_grad[flat])
            if not in_place:
                grad_logits[o, a:b, :valid_width].copy_(out)
        return (grad_logits,) + (None,) * 7


def _validate(logits, target_ids, tp_size, vocab_size, padded_vocab_size, temperature, chunk_size,
              check_targets) -> int:
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
        raise ValueError(f"target_ids shape {tuple(target_ids.shape)} must equal logits.shape[:-1] "
                         f"{tuple(logits.shape[:-1])}")
    if target_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"target_ids must be int64 (or int32) global token ids; got {target_ids.dtype}")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be a positive token count or None")
    if check_targets and target_ids.numel() > 0 and bool(((target_ids < 0) | (target_ids >= vocab)).any()):
        bad = target_ids[(target_ids < 0) | (target_ids >= vocab)][:4].tolist()
        raise ValueError(f"target_ids contain ids outside [0, vocab_size={vocab}) e.g. {bad}; padded-vocabulary "
                         "columns are never targets: map padding to a real id and mask it out")
    return vocab


def vocab_parallel_logprobs_entropy(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = True,
    entropy_requires_grad: bool = False,
    padded_vocab_size: int | None = None,
    check_targets: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities of ``target_ids`` and full-vocabulary entropy from a vocabulary shard.

    Args:
        logits: ``[..., V/tp]`` this rank's vocabulary shard, any float dtype, any leading shape. Not modified and
            not copied: a non-contiguous view such as ``logits[:, :-1]`` of ``[B, S, V/tp]`` is processed sequence
            by sequence (only dims before the last two are merged; they should be viewable, else reshape copies).
        target_ids: ``[...]`` int64 token ids in the *global* vocabulary, all in ``[0, vocab_size)``.
        tp_group: tensor-parallel group sharding the vocabulary; ``None`` means ``logits`` holds all V columns.
        vocab_size: real vocabulary size; columns ``>= vocab_size`` (Megatron's padding) get no probability mass,
            no entropy contribution and zero gradient. Default: all ``V`` columns.
        temperature: logits are divided by it before both quantities (> 0).
        chunk_size: tokens per chunk; the fp32 working set is two ``[chunk_size, V/tp]`` buffers (reused by
            every chunk), and backward recomputes the softmax chunk by chunk from the saved logits (nothing of
            size ``V`` is saved). ``None``: one chunk (per leading index for a non-contiguous view), i.e. two fp32
            copies of the whole shard.
        with_entropy: also return the entropy (its statistics cost one multiply-add per element either way).
        entropy_requires_grad: make the entropy differentiable (exact gradient); otherwise it is detached.
        padded_vocab_size: optional ``V`` to validate ``logits.shape[-1] * tp_size == V``.
        check_targets: validate the target range (one host sync); turn off in hot loops once inputs are trusted.

    Returns:
        ``(logprobs, entropy)``: ``logprobs`` ``[...]`` fp32 natural-log probabilities, differentiable w.r.t.
        ``logits`` (gradient in ``logits.dtype``, computed in fp32); ``entropy`` ``[...]`` fp32 in nats, or None.

    Collectives:
        Two all-reduces on ``tp_group`` in forward (MAX of ``[N]`` row maxima; SUM of a ``[3, N]`` stack of
        sum-exp, target logit and sum exp*logit), none in backward. Not differentiable themselves; the
        gradient of each shard is local because the forward saved the global statistics.

    Raises:
        ValueError: shard width inconsistent with ``padded_vocab_size``, ``vocab_size`` out of range, target ids
            outside ``[0, vocab_size)`` (with ``check_targets``), shape/dtype mismatches, ``temperature <= 0``,
            ``chunk_size < 1``.
    """
    tp_size, tp_rank = _tp_size_rank(tp_group)
    vocab = _validate(logits, target_ids, tp_size, vocab_size, padded_vocab_size, temperature, chunk_size,
                      check_targets)
    local_width = logits.shape[-1]
    vocab_start = tp_rank * local_width
    valid_width = max(0, min(local_width, vocab - vocab_start))
    batch_shape = target_ids.shape
    if logits.dim() <= 2 or logits.is_contiguous():
        logits_OIV = logits.reshape(1, -1, local_width)  # a view: one flat run of tokens
    else:  # e.g. logits[:, :-1] of [B, S, V/tp]: chunk within each sequence instead of copying the logits
        logits_OIV = logits.flatten(0, -3)
    logprobs, entropy = _LogprobsEntropy.apply(
        logits_OIV, target_ids.reshape(-1).long(), tp_group, vocab_start, valid_width, float(temperature),
        chunk_size, with_entropy and entropy_requires_grad,
    )
    logprobs = logprobs.view(batch_shape)
    return logprobs, (entropy.view(batch_shape) if with_entropy else None)
