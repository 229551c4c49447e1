"""Naive float64 single-process references for ``gtpo_megatron.ops`` (share no code with ``ops/``).

Each one is the most obvious formulation: ``log_softmax`` then ``gather``, entropy as ``-sum p log p``, plain
Python loops over groups, completions and tokens for advantages, conflicts, the filter and the losses.
"""

from __future__ import annotations

import math
import statistics

import torch

LN2 = math.log(2)


def ref_logprobs_entropy(full_logits, target_ids, *, vocab_size=None, temperature=1.0):
    """float64 ``(logprobs, entropy)`` from the FULL ``[..., V]`` logits; differentiable if the input is.

    A ``-inf`` logit is a token of probability 0: its ``0 * log 0`` entropy term is 0 (and gets no gradient).
    """
    vocab = full_logits.shape[-1] if vocab_size is None else vocab_size
    logp = torch.log_softmax(full_logits.double()[..., :vocab] / temperature, dim=-1)
    picked = logp.gather(-1, target_ids.long().unsqueeze(-1)).squeeze(-1)
    p = logp.exp()
    entropy = -(p * logp.masked_fill(p == 0, 0.0)).sum(dim=-1)
    return picked, entropy


def ref_group_advantages(rewards: list[float], group_size: int, estimator: str, eps: float = 1e-6) -> list[float]:
    """Per-group mean-centred (optionally std-normalised, unbiased std) advantages, in Python floats."""
    out = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start : start + group_size]
        if len(set(group)) == 1:
            out += [0.0] * len(group)
            continue
        mean = math.fsum(group) / len(group)
        scale = statistics.stdev(group) + eps if estimator == "group_mean_std" else 1.0
        out += [(r - mean) / scale for r in group]
    return out


def _run_length(flags: list[bool]) -> int:
    n = 0
    for flag in flags:
        if not flag:
            break
        n += 1
    return n


def ref_conflict_weights(
    completions, advantages, group_size, *, amplification=2.0, mode="prefix_suffix", overlap="once"
):
    """Per-completion weight lists (one float per response token) with Python loops (docs/algorithm.md section 3).

    ``completions`` is a list of unpadded response-token lists, group by group.
    """
    weights = []
    for start in range(0, len(completions), group_size):
        group = completions[start : start + group_size]
        signs = advantages[start : start + group_size]
        for seq, adv in zip(group, signs):
            front = [_raw(group, signs, seq[t], t, from_end=False) for t in range(len(seq))]
            back = [_raw(group, signs, seq[-1 - k], k, from_end=True) for k in range(len(seq))]
            if mode == "any_position":
                in_front, in_back = front, [False] * len(seq)
            else:
                n_front, n_back = _run_length(front), _run_length(back)
                in_front = [t < n_front for t in range(len(seq))]
                in_back = [len(seq) - 1 - t < n_back for t in range(len(seq))]
            row = []
            for t in range(len(seq)):
                hit = in_front[t] or in_back[t]
                if hit and adv > 0:
                    both = in_front[t] and in_back[t] and overlap == "multiply"
                    row.append(amplification * amplification if both else amplification)
                elif hit and adv < 0:
                    row.append(0.0)
                else:
                    row.append(1.0)
            weights.append(row)
    return weights


def _raw(group, signs, token, k, *, from_end):
    def at(seq):
        if k >= len(seq):
            return None
        return seq[-1 - k] if from_end else seq[k]

    in_pos = any(at(s) == token for s, a in zip(group, signs) if a > 0)
    in_neg = any(at(s) == token for s, a in zip(group, signs) if a < 0)
    return in_pos and in_neg


def ref_keep(seq_entropy, *, mode, threshold=LN2, initial_entropy=None, advantages=None, only_negative=False):
    """Entropy-filter decisions (list of bool, True = keep) written as the spec's if/else."""
    keep = []
    for i, h in enumerate(seq_entropy):
        if mode == "off":
            drop = False
        elif mode == "fixed":
            drop = h > threshold
        else:
            drop = initial_entropy <= threshold and h > threshold
        if only_negative and advantages[i] >= 0:
            drop = False
        keep.append(not drop)
    return keep


def ref_policy_loss(
    policy_logprobs,
    old_logprobs,
    advantages,
    token_weights,
    lengths,
    *,
    aggregation,
    normalizer,
    clip_low,
    clip_high,
    ref_logprobs=None,
    kl_coef=0.0,
    kl_estimator="k3",
    is_weights=None,
):
    """float64 loss as a token loop over unpadded rows (``lengths[i]`` leading tokens of row i are the response).

    ``policy_logprobs`` may require grad (float64 tensor ``[B, T]``); ``is_weights`` ``[B, T]`` multiplies each
    token's surrogate (not its KL term); returns a float64 scalar tensor.
    """
    total = torch.zeros((), dtype=torch.float64)
    for i, n in enumerate(lengths):
        row = torch.zeros((), dtype=torch.float64)
        for t in range(n):
            lp = policy_logprobs[i, t]
            old = lp.detach() if old_logprobs is None else old_logprobs[i, t]
            ratio = torch.exp(lp - old)
            adv = float(advantages[i])
            surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * adv)
            term = -surrogate * float(token_weights[i, t])
            if is_weights is not None:
                term = term * float(is_weights[i, t])
            if kl_coef:
                d = float(ref_logprobs[i, t]) - lp
                if kl_estimator == "k1":
                    kl = -d
                elif kl_estimator == "k2":
                    kl = d * d / 2
                else:
                    kl = torch.exp(d) - d - 1
                term = term + kl_coef * kl
            row = row + term
        if aggregation == "seq-mean-token-mean" and n > 0:
            row = row / n
        total = total + row
    return total / normalizer
