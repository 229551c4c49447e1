"""Evaluation metrics: unbiased pass@k, maj@k, and their aggregation over a benchmark.

Per problem, n completions are sampled; ``c`` of them are correct (the reward's ``correct`` field, the same code
as training).

- pass@k (Chen et al. 2021, unbiased): ``1 - C(n-c, k) / C(n, k)``, the probability that at least one of k
  completions drawn without replacement from the n is correct. Computed as ``1 - prod_{i=n-c+1}^{n} (1 - k/i)``,
  which never forms a binomial coefficient (no overflow for n = 64 or 1024) and is exact to float rounding.
- maj@k: majority vote over the extracted answers of the FIRST k completions, by equivalence classes: two answers
  are in one class when ``same(a, b)`` holds (the reward's own equivalence, ``rewards.math_answer.same_answer``,
  run by the evaluator in the reward pool), closed transitively (connected components), and only answers with the
  same correctness verdict are ever joined, so every class is wholly correct or wholly wrong. Completions without
  an extracted answer (none stated, or the grader failed) do not vote. The largest class wins; when several tie,
  maj@k is the fraction of the tied classes that are correct, i.e. the expected score of breaking the tie
  uniformly at random. That value does not depend on the order of the samples and favours neither right nor
  wrong answers (gold 9, votes ``[9, 9, 5, 5]`` or ``[5, 5, 9, 9]``: 0.5). 0 when nobody voted.

Benchmark numbers are means over problems, reported as fractions in [0, 1] (the Markdown report shows percent).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

SameAnswer = Callable[[str, str], bool]


@dataclass(frozen=True, slots=True)
class SampleRecord:
    """One scored completion of one problem.

    Attributes:
        answer: the extracted answer ("" when none was extracted or grading failed).
        correct: the reward's correctness verdict.
        format_ok: the strict reasoning/answer format was respected.
        num_tokens: completion length in tokens.
        truncated: generation stopped at max_tokens (finish reason "length").
    """

    answer: str
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


def answer_classes(samples: Sequence[SampleRecord], same: SameAnswer) -> list[int]:
    """Class id of each sample's answer (-1 for no answer); rules in the module docstring.

    Ids number the classes in order of first appearance; which answers share a class does not depend on order.
    """
    keys = list(dict.fromkeys((s.answer, s.correct) for s in samples if s.answer))
    parent = list(range(len(keys)))

    def root(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    for i, (answer_i, correct_i) in enumerate(keys):
        for j in range(i):
            answer_j, correct_j = keys[j]
            if correct_i == correct_j and root(i) != root(j) and same(answer_j, answer_i):
                parent[root(i)] = root(j)
    roots = {key: root(i) for i, key in enumerate(keys)}
    ids = {r: n for n, r in enumerate(dict.fromkeys(roots.values()))}
    return [ids[roots[(s.answer, s.correct)]] if s.answer else -1 for s in samples]


def maj_at_k(samples: Sequence[SampleRecord], k: int, same: SameAnswer) -> float:
    """maj@k of one problem over its first ``k`` samples (classes and tie rule in the module docstring).

    Args:
        samples: the problem's samples in sampling order.
        k: votes counted, ``1 <= k <= len(samples)``.
        same: whether two extracted answers are the same answer (symmetric).

    Raises:
        ValueError: unless ``1 <= k <= len(samples)``.
    """
    if not 1 <= k <= len(samples):
        raise ValueError(f"k={k} must be between 1 and num_samples={len(samples)} for maj@k")
    head = samples[:k]
    classes = answer_classes(head, same)
    votes = Counter(c for c in classes if c >= 0)
    if not votes:
        return 0.0
    top = max(votes.values())
    tied = [c for c, n in votes.items() if n == top]
    correct = {c: s.correct for c, s in zip(classes, head, strict=True) if c >= 0}
    return sum(correct[c] for c in tied) / len(tied)


def problem_metrics(samples: Sequence[SampleRecord], ks: Sequence[int], same: SameAnswer) -> dict[str, float]:
    """pass@k and maj@k for every k in ``ks`` for one problem's samples (``same`` as in :func:`maj_at_k`)."""
    n = len(samples)
    c = sum(s.correct for s in samples)
    out: dict[str, float] = {}
    for k in ks:
        out[f"pass@{k}"] = pass_at_k(n, c, k)
        out[f"maj@{k}"] = maj_at_k(samples, k, same)
    return out


def aggregate(
    problems: Sequence[Sequence[SampleRecord]], ks: Sequence[int], same: Sequence[SameAnswer]
) -> dict[str, float]:
    """Benchmark summary: mean pass@k and maj@k over problems, and sample-level rates.

    ``same[i]`` is problem ``i``'s answer equivalence (see :func:`maj_at_k`).

    Returns:
        ``pass@k``/``maj@k`` per k, ``num_no_answer`` (samples without an extracted answer: none stated, or the
        grader failed; they score 0), ``accuracy`` (fraction of correct samples), ``format_rate``,
        ``truncation_rate``, ``mean_length`` (tokens), ``num_problems``, ``num_samples`` (per problem).

    Raises:
        ValueError: no problems, or problems with different sample counts.
    """
    if not problems:
        raise ValueError("aggregate needs at least one problem; the benchmark selection is empty (check --limit)")
    sizes = {len(p) for p in problems}
    if len(sizes) != 1:
        raise ValueError(f"every problem needs the same number of samples for pass@k; got sizes {sorted(sizes)}")
    per_problem = [problem_metrics(p, ks, eq) for p, eq in zip(problems, same, strict=True)]
    summary = {key: sum(m[key] for m in per_problem) / len(per_problem) for key in per_problem[0]}
    samples = [s for p in problems for s in p]
    summary.update(
        num_no_answer=float(sum(not s.answer for s in samples)),
        accuracy=sum(s.correct for s in samples) / len(samples),
        format_rate=sum(s.format_ok for s in samples) / len(samples),
        truncation_rate=sum(s.truncated for s in samples) / len(samples),
        mean_length=sum(s.num_tokens for s in samples) / len(samples),
        num_problems=float(len(problems)),
        num_samples=float(sizes.pop()),
    )
    return summary


def _is_count(key: str) -> bool:
    return key != "num_samples" and key.rsplit("/", 1)[-1].startswith("num_")


def pool_summaries(summaries: Sequence[dict[str, float]]) -> dict[str, float]:
    """:func:`aggregate` of the union of several benchmarks (MMLU's subjects) from their summaries.

    Counts (``num_*``) add up; every other value is a mean over problems (or samples), weighted by ``num_problems``.

    Raises:
        ValueError: no summary, or different samples per problem.
    """
    sizes = {s["num_samples"] for s in summaries}
    if len(sizes) != 1:
        raise ValueError(f"pooling needs summaries with one num_samples per problem; got {sorted(sizes)}")
    total = sum(s["num_problems"] for s in summaries)
    pooled = {}
    for key in summaries[0]:
        if _is_count(key):
            pooled[key] = sum(s[key] for s in summaries)
        else:
            pooled[key] = sum(s[key] * s["num_problems"] for s in summaries) / total
    return pooled
