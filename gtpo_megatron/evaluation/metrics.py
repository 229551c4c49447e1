"""Evaluation metrics: unbiased pass@k, maj@k, and their aggregation over a benchmark.

Per problem, n completions are sampled; ``c`` of them are correct (the reward's ``correct`` field, the same code
as training).

- pass@k (Chen et al. 2021, unbiased): ``1 - C(n-c, k) / C(n, k)``, the probability that at least one of k
  completions drawn without replacement from the n is correct. Computed as ``1 - prod_{i=n-c+1}^{n} (1 - k/i)``,
  which never forms a binomial coefficient (no overflow for n = 64 or 1024) and is exact to float rounding.
- maj@k: majority vote over the normalised answers (``rewards.math_answer.normalize_answer``) of the FIRST k
  completions; completions without an extracted answer do not vote. Ties go to the tied answer that appears first
  among those k completions (deterministic, independent of hashing). The vote scores 1 when the first completion
  carrying the winning answer is correct, 0 when it is not or when nobody voted.

Benchmark numbers are means over problems, reported as fractions in [0, 1] (the Markdown report shows percent).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SampleRecord:
    """One scored completion of one problem.

    Attributes:
        normalized: normalised extracted answer ("" when none was extracted).
        correct: the reward's correctness verdict.
        format_ok: the strict reasoning/answer format was respected.
        num_tokens: completion length in tokens.
        truncated: generation stopped at max_tokens (finish reason "length").
    """

    normalized: str
    correct: bool
    format_ok: bool
    num_tokens: int
    truncated: bool


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with ``c`` correct out of ``n`` samples.

    Raises:
        ValueError: unless ``0 <= c <= n`` and ``1 <= k <= n``.
    """
    if not 0 <= c <= n:
        raise ValueError(f"num_correct={c} must be between 0 and num_samples={n}")
    if not 1 <= k <= n:
        raise ValueError(f"k={k} must be between 1 and num_samples={n}; sample at least k completions (--n >= k)")
    if n - c < k:
        return 1.0
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


def majority_answer(normalized: Sequence[str]) -> int | None:
    """Index of the completion whose answer wins the vote (first occurrence), None when nobody voted.

    Empty strings do not vote; ties go to the answer that appears first.
    """
    votes = Counter(a for a in normalized if a)
    if not votes:
        return None
    best = max(votes.values())
    for i, answer in enumerate(normalized):
        if answer and votes[answer] == best:
            return i
    raise AssertionError("unreachable: a voted answer must appear in the list")


def maj_at_k(samples: Sequence[SampleRecord], k: int) -> float:
    """1.0 if the majority answer of the first ``k`` samples is correct, else 0.0 (rules in the module docstring).

    Raises:
        ValueError: unless ``1 <= k <= len(samples)``.
    """
    if not 1 <= k <= len(samples):
        raise ValueError(f"k={k} must be between 1 and num_samples={len(samples)} for maj@k")
    head = samples[:k]
    winner = majority_answer([s.normalized for s in head])
    return float(winner is not None and head[winner].correct)


def problem_metrics(samples: Sequence[SampleRecord], ks: Sequence[int]) -> dict[str, float]:
    """pass@k and maj@k for every k in ``ks`` for one problem's samples."""
    n = len(samples)
    c = sum(s.correct for s in samples)
    out: dict[str, float] = {}
    for k in ks:
        out[f"pass@{k}"] = pass_at_k(n, c, k)
        out[f"maj@{k}"] = maj_at_k(samples, k)
    return out


def aggregate(problems: Sequence[Sequence[SampleRecord]], ks: Sequence[int]) -> dict[str, float]:
    """Benchmark summary: mean pass@k and maj@k over problems, and sample-level rates.

    Returns:
        ``pass@k``/``maj@k`` per k, ``accuracy`` (fraction of correct samples), ``format_rate``,
        ``truncation_rate``, ``mean_length`` (tokens), ``num_problems``, ``num_samples``.

    Raises:
        ValueError: no problems, or problems with different sample counts.
    """
    if not problems:
        raise ValueError("aggregate needs at least one problem; the benchmark selection is empty (check --limit)")
    sizes = {len(p) for p in problems}
    if len(sizes) != 1:
        raise ValueError(f"every problem needs the same number of samples for pass@k; got sizes {sorted(sizes)}")
    per_problem = [problem_metrics(p, ks) for p in problems]
    summary = {key: sum(m[key] for m in per_problem) / len(per_problem) for key in per_problem[0]}
    samples = [s for p in problems for s in p]
    summary.update(
        accuracy=sum(s.correct for s in samples) / len(samples),
        format_rate=sum(s.format_ok for s in samples) / len(samples),
        truncation_rate=sum(s.truncated for s in samples) / len(samples),
        mean_length=sum(s.num_tokens for s in samples) / len(samples),
        num_problems=float(len(problems)),
        num_samples=float(sizes.pop()),
    )
    return summary
