"""Run benchmarks with vLLM and score them with the training reward code (docs/algorithm.md sections 6-7).

For each benchmark: load the problems (``data.datasets.load_problems``, test split), build the same chat prompts
as training (``data.prompts.build_prompt_ids``), sample n completions per problem with ``VLLMEngine`` (per-request
seeds derived from ``--seed``, so the same seed, model and flags give the same numbers), score every completion
with the registered reward in a ``RewardPool`` in the benchmark's extraction mode (``--extraction``, default
``rewards.default_extraction``: ``lenient`` for GSM8K, ``strict`` for MATH-500/AIME/AMC/MMLU), and aggregate with
``evaluation.metrics``: the reward's ``correct`` verdict drives pass@k and maj@k; its ``extracted`` answers vote
for maj@k in equivalence classes decided by the same pool (``RewardPool.same_answers``, the reward's own
equivalence). MMLU (``mmlu`` or ``mmlu/<subject>``, ``data.mmlu``) is evaluated subject by subject
(``mmlu/<subject>`` entries, ``--limit`` questions each) and pooled into an ``mmlu`` entry over all its questions.

Outputs in ``output_dir``:
- ``results.json``: ``{"model", "config", "extraction": {benchmark: mode}, "results": {benchmark: {"pass@k",
  "maj@k", "accuracy", "format_rate", "truncation_rate", "mean_length", "num_problems", "num_samples",
  "num_no_answer", "reward/num_timeouts", "reward/num_errors"}}, "seconds"}``; rates are fractions in [0, 1];
  ``num_no_answer`` counts completions without an extracted answer, the last two the grader's timeouts and errors
  (scoring and maj@k classes; a failed answer scores 0 and does not vote). When these exceed ``--max-error-frac``
  of a benchmark's answers the evaluation stops (``check_grader_failures``).
- ``results.md``: a table laid out like the paper's Table 1 (one row per model, p@k and maj@k columns per
  benchmark, in percent), a table of sample-level rates and grader failures, and one of MMLU's subjects.
- ``records/<benchmark>.jsonl``: one line per problem (id, reference, per-sample text, extracted answer,
  correctness, format, length, finish reason, and the problem's pass@k/maj@k) for auditing.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gtpo_megatron.builtin_models import resolve_model_path
from gtpo_megatron.data.datasets import load_problems
from gtpo_megatron.data.mmlu import MMLU, is_mmlu
from gtpo_megatron.data.prompts import SYSTEM_PROMPTS, build_prompt_ids
from gtpo_megatron.evaluation.checkpoint_export import AdapterFolder, export_adapter_folder
from gtpo_megatron.evaluation.metrics import SameAnswer, SampleRecord, aggregate, pool_summaries, problem_metrics
from gtpo_megatron.rewards.answer_text import check_extraction, default_extraction
from gtpo_megatron.rewards.pool import RewardPool, check_error_frac, check_grader_failures
from gtpo_megatron.rollout.engine import RolloutEngine, SamplingConfig

if TYPE_CHECKING:
    from gtpo_megatron.data.datasets import Problem

BENCHMARKS = ("gsm8k", "math500", "aime24", "aime25", "amc23")
DISPLAY_NAMES = {
    "gsm8k": "GSM8K",
    "math500": "MATH-500",
    "aime24": "AIME24",
    "aime25": "AIME25",
    "amc23": "AMC23",
    MMLU: "MMLU",
}
_MEGATRON_MARKERS = ("latest_checkpointed_iteration.txt", ".metadata")  # Megatron-LM layouts we do not convert
logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalConfig:
    """Everything one evaluation run needs (the CLI flags of ``gtpo-eval``; see ``evaluation/cli.py``)."""

    model: str
    output_dir: str
    benchmarks: tuple[str, ...] = BENCHMARKS
    data_dir: str | None = None
    limit: int | None = None
    n: int = 64
    ks: tuple[int, ...] = (1, 8, 16, 32, 64)
    temperature: float = 0.9
    top_p: float = 1.0
    max_tokens: int = 1500
    seed: int = 0
    reward: str = "math_verify"
    extraction: str | None = None
    reward_workers: int = 2
    reward_timeout_s: float = 5.0
    max_error_frac: float = 0.5
    dtype: str = "auto"
    max_model_len: int | None = None
    in_process: bool = False
    label: str | None = None
    system_prompt: str = "concise"
    lora_format: str = "merged"
    """A LoRA run's checkpoint: ``merged`` weights, or ``adapter``: the base model serving its PEFT folder."""
    sampling: SamplingConfig = field(init=False)

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n={self.n} must be >= 1 completions per problem")
        bad = [k for k in self.ks if not 1 <= k <= self.n]
        if not self.ks or bad:
            raise ValueError(f"k values {list(self.ks)} must be non-empty and each in [1, n={self.n}]; raise --n")
        if not self.benchmarks:
            raise ValueError("benchmarks is empty; pass e.g. --benchmarks gsm8k,amc23")
        if self.extraction is not None:
            check_extraction(self.extraction, field="--extraction")
        check_error_frac(self.max_error_frac, field="--max-error-frac")
        if self.system_prompt not in SYSTEM_PROMPTS:
            raise ValueError(
                f"--system-prompt {self.system_prompt!r}: choose one of {sorted(SYSTEM_PROMPTS)} (the training "
                "run's data.system_prompt)"
            )
        if self.lora_format not in ("merged", "adapter"):
            raise ValueError(f"--lora-format {self.lora_format!r}: choose merged or adapter")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit={self.limit} must be >= 1 problems per benchmark; omit --limit for all")
        if self.model.startswith(("/", ".", "~")) and not Path(self.model).expanduser().exists():
            raise ValueError(
                f"--model {self.model}: no such folder; pass a Hugging Face model folder, a gtpo-train "
                "run dir or checkpoint, a hub name (org/model) or a builtin: name"
            )
        sampling = SamplingConfig(
            temperature=self.temperature, top_p=self.top_p, max_tokens=self.max_tokens, seed=self.seed
        )
        object.__setattr__(self, "sampling", sampling)

    def extraction_for(self, benchmark: str) -> str:
        """The extraction mode of ``benchmark``: ``extraction`` when set, else the benchmark's default."""
        return self.extraction or default_extraction(benchmark)


def resolve_hf_model(model: str) -> str:
    """HF folder (or hub name) for ``model``; built-in names are materialised, Megatron checkpoints exported.

    A Megatron checkpoint of a training run (its step folder, its ``checkpoints/`` folder or the run dir) is
    converted once into ``<step dir>/hf/`` by ``checkpoint_export.export_checkpoint_to_hf`` and that folder is
    returned (reused on later calls).

    Raises:
        ValueError: ``model`` is a folder that is neither a Hugging Face model nor a run's Megatron checkpoint.
        FileNotFoundError: a Megatron checkpoint without its run's ``config.yaml`` two levels up.
    """
    from gtpo_megatron.evaluation.checkpoint_export import export_checkpoint_to_hf
    from gtpo_megatron.run_dir import is_megatron_checkpoint

    path = Path(resolve_model_path(model))
    if not path.is_dir():
        return str(path)
    if (path / "config.json").exists():
        return str(path)
    if is_megatron_checkpoint(path):
        return str(export_checkpoint_to_hf(path))
    if any((path / m).exists() for m in _MEGATRON_MARKERS) or any(path.glob("iter_*")):
        raise ValueError(
            f"--model {model} looks like a Megatron checkpoint of another trainer (Megatron-LM iter_* layout); "
            "only checkpoints written by gtpo-train (RUN_DIR/checkpoints/step_NNNNNN) are converted. Pass a "
            "Hugging Face folder instead"
        )
    raise ValueError(
        f"--model {model} is a folder without config.json; pass a Hugging Face model folder, a "
        "gtpo-train run dir or one of its checkpoints/step_NNNNNN folders"
    )


def _to_samples(out, results) -> list[SampleRecord]:
    return [
        SampleRecord(
            answer=r.extracted or "",
            correct=r.correct,
            format_ok=r.format_ok,
            num_tokens=len(c.token_ids),
            truncated=c.finish_reason == "length",
        )
        for c, r in zip(out.completions, results, strict=True)
    ]


def _is_same(same_pairs: frozenset[frozenset[str]], first: str, second: str) -> bool:
    return first == second or frozenset((first, second)) in same_pairs


def _candidate_pairs(samples: list[SampleRecord]) -> list[tuple[str, str]]:
    """Pairs of distinct answers of one problem that may join a maj@k class (same correctness verdict)."""
    keys = list(dict.fromkeys((s.answer, s.correct) for s in samples if s.answer))
    return [(a, b) for i, (a, ok_a) in enumerate(keys) for b, ok_b in keys[:i] if ok_a == ok_b and a != b]


def answer_equivalences(pool: RewardPool, problems: list[list[SampleRecord]]) -> tuple[list[SameAnswer], dict]:
    """Each problem's ``same(a, b)`` for maj@k, decided by the reward pool in one call; returns it and the stats."""
    pairs = [_candidate_pairs(samples) for samples in problems]
    verdicts, stats = pool.same_answers([pair for problem_pairs in pairs for pair in problem_pairs])
    same, start = [], 0
    for problem_pairs in pairs:
        chunk = verdicts[start : start + len(problem_pairs)]
        start += len(problem_pairs)
        same_pairs = frozenset(frozenset(p) for p, ok in zip(problem_pairs, chunk, strict=True) if ok)
        same.append(functools.partial(_is_same, same_pairs))
    return same, stats


def _problem_record(problem: Problem, out, results, samples, metrics) -> dict[str, Any]:
    completions = [
        {
            "text": c.text,
            "extracted": r.extracted,
            "correct": r.correct,
            "format_ok": r.format_ok,
            "score": r.score,
            "num_tokens": s.num_tokens,
            "finish_reason": c.finish_reason,
        }
        for c, r, s in zip(out.completions, results, samples, strict=True)
    ]
    return {
        "id": problem.id,
        "reference": problem.answer,
        "num_correct": sum(s.correct for s in samples),
        **metrics,
        "completions": completions,
    }


def _grader_failures(name: str, *stats: dict) -> dict[str, float]:
    """``reward/num_timeouts`` and ``reward/num_errors`` of a benchmark's pool calls, logged when not zero."""
    counts = {
        "reward/num_timeouts": float(sum(s["num_timeouts"] for s in stats)),
        "reward/num_errors": float(sum(s["num_errors"] for s in stats)),
    }
    if any(counts.values()):
        examples = [e for s in stats for e in s["errors"]][:3]
        logger.warning(
            "%s: the grader failed on %d answers (%d timeouts, %d errors), scored 0; e.g. %s",
            name,
            sum(counts.values()),
            counts["reward/num_timeouts"],
            counts["reward/num_errors"],
            examples,
        )
    return counts


def evaluate_benchmark(
    engine: RolloutEngine,
    pool: RewardPool,
    name: str,
    problems: list[Problem],
    prompts: list[list[int]],
    config: EvalConfig,
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Sample, score and aggregate benchmark ``name``; returns ``(summary, per-problem records)``."""
    outputs = engine.generate(prompts, config.n, config.sampling)
    texts = [c.text for out in outputs for c in out.completions]
    references = [p.answer for p in problems for _ in range(config.n)]
    results, score_stats = pool.score(texts, references, extraction=config.extraction_for(name))
    stop_on_failures = functools.partial(
        check_grader_failures,
        max_error_frac=config.max_error_frac,
        where=f"benchmark {name!r}: ",
        fields=("--max-error-frac", "--reward-timeout"),
    )
    stop_on_failures(score_stats)
    chunks = [results[i * config.n : (i + 1) * config.n] for i in range(len(problems))]
    samples = [_to_samples(out, chunk) for out, chunk in zip(outputs, chunks, strict=True)]
    same, vote_stats = answer_equivalences(pool, samples)
    stop_on_failures(vote_stats)
    records = [
        _problem_record(problem, out, chunk, s, problem_metrics(s, config.ks, eq))
        for problem, out, chunk, s, eq in zip(problems, outputs, chunks, samples, same, strict=True)
    ]
    summary = aggregate(samples, config.ks, same) | _grader_failures(name, score_stats, vote_stats)
    return summary, records


def markdown_report(label: str, results: dict[str, dict[str, float]], ks: tuple[int, ...]) -> str:
    """Table 1 layout (percent): one row per model, p@k columns per benchmark and maj@max(k); then sample rates.

    Per-subject results (``mmlu/<subject>``) get rows in the rates table and a table of their own.
    """
    k_max = max(ks)
    main = [b for b in results if "/" not in b]
    cols = [(b, f"pass@{k}", f"p@{k}") for b in main for k in ks] + [(b, f"maj@{k_max}", f"maj@{k_max}") for b in main]
    cols.sort(key=lambda c: main.index(c[0]))
    head = "| model | " + " | ".join(f"{DISPLAY_NAMES.get(b, b)} {name}" for b, _, name in cols) + " |"
    row = f"| {label} | " + " | ".join(f"{100 * results[b][key]:.1f}" for b, key, _ in cols) + " |"
    lines = [
        head,
        "|" + "---|" * (len(cols) + 1),
        row,
        "",
        "| benchmark | problems | n | accuracy | format rate | truncated | mean length | grader timeouts/errors "
        "| no answer |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for b, r in results.items():
        lines.append(
            f"| {DISPLAY_NAMES.get(b, b)} | {r['num_problems']:.0f} | {r['num_samples']:.0f} | "
            f"{100 * r['accuracy']:.1f} | {100 * r['format_rate']:.1f} | {100 * r['truncation_rate']:.1f} "
            f"| {r['mean_length']:.1f} | {r['reward/num_timeouts']:.0f}/{r['reward/num_errors']:.0f} "
            f"| {r.get('num_no_answer', 0):.0f} |"
        )
    return "\n".join(lines + _subject_table(results, ks)) + "\n"


def _subject_table(results: dict[str, dict[str, float]], ks: tuple[int, ...]) -> list[str]:
    """Lines of the per-subject table (percent): accuracy, p@k and maj@max(k); none without subjects."""
    subjects = [b for b in results if "/" in b]
    if not subjects:
        return []
    keys = [f"pass@{k}" for k in ks] + [f"maj@{max(ks)}"]
    lines = ["", "| subject | problems | accuracy | " + " | ".join(keys) + " |", "|---|---|---|" + "---|" * len(keys)]
    for b in subjects:
        r = results[b]
        values = " | ".join(f"{100 * r[key]:.1f}" for key in keys)
        lines.append(f"| {b} | {r['num_problems']:.0f} | {100 * r['accuracy']:.1f} | {values} |")
    return lines


def _problem_sets(name: str, config: EvalConfig) -> dict[str, list[Problem]]:
    """``{benchmark: problems}`` of one ``--benchmarks`` name; MMLU becomes one set per subject (``--limit`` each)."""
    if not is_mmlu(name):
        return {name: load_problems(name, split="test", limit=config.limit, data_dir=config.data_dir)}
    by_subject: dict[str, list[Problem]] = {}
    for problem in load_problems(name, split="test", data_dir=config.data_dir):
        by_subject.setdefault(problem.source, []).append(problem)
    return {subject: problems[: config.limit] for subject, problems in by_subject.items()}


def pool_subjects(results: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """``{"mmlu": pooled}`` over the ``mmlu/<subject>`` entries of ``results`` (none: empty)."""
    subjects = [r for b, r in results.items() if b.startswith(MMLU + "/")]
    return {MMLU: pool_summaries(subjects)} if subjects else {}


def _load_benchmarks(config: EvalConfig, tokenizer) -> dict[str, tuple[list[Problem], list[list[int]]]]:
    loaded = {}
    system_prompt = SYSTEM_PROMPTS[config.system_prompt]
    for name in config.benchmarks:
        for benchmark, problems in _problem_sets(name, config).items():
            prompts = [build_prompt_ids(tokenizer, p.question, system_prompt=system_prompt) for p in problems]
            loaded[benchmark] = (problems, prompts)
    return loaded


def _build_engine(config: EvalConfig, model_path: str, max_prompt_len: int, adapter: AdapterFolder | None):
    """The evaluation's ``VLLMEngine``; with ``adapter`` it serves that PEFT folder on ``model_path`` (the base)."""
    from gtpo_megatron.rollout.engine_settings import EngineSettings
    from gtpo_megatron.rollout.vllm_engine import VLLMEngine

    max_model_len = config.max_model_len or max_prompt_len + config.max_tokens
    rank = None if adapter is None else adapter.rank
    settings = EngineSettings(dtype=config.dtype, max_model_len=max_model_len, seed=config.seed,
                              in_process=config.in_process, max_lora_rank=rank)  # fmt: skip
    engine = VLLMEngine(model_path, settings)
    if adapter is not None:
        engine.load_adapter(str(adapter.folder))
    return engine


def run_evaluation(config: EvalConfig, *, engine: RolloutEngine | None = None) -> dict[str, Any]:
    """Evaluate ``config.model`` on ``config.benchmarks`` and write the outputs (module docstring).

    Args:
        config: the run settings.
        engine: an engine already serving ``config.model`` (tests share one); built and closed here if None.

    Returns:
        The ``results.json`` content.

    Raises:
        ValueError / FileNotFoundError: bad model folder or benchmark file (from the loaders, naming file and line).
        FileNotFoundError: a Megatron checkpoint without its run's ``config.yaml`` (see ``resolve_hf_model``).
    """
    from transformers import AutoTokenizer

    start = time.perf_counter()
    adapter = export_adapter_folder(config.model) if config.lora_format == "adapter" else None
    model_path = adapter.base_model if adapter is not None else resolve_hf_model(config.model)
    benchmarks = _load_benchmarks(config, AutoTokenizer.from_pretrained(model_path))
    own_engine = engine is None
    if own_engine:
        longest_prompt = max((len(p) for _, prompts in benchmarks.values() for p in prompts), default=1)
        engine = _build_engine(config, model_path, longest_prompt, adapter)
    out_dir = Path(config.output_dir)
    (out_dir / "records").mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, float]] = {}
    try:
        with RewardPool(config.reward, num_workers=config.reward_workers, timeout_s=config.reward_timeout_s) as pool:
            for name, (problems, prompts) in benchmarks.items():
                results[name], records = evaluate_benchmark(engine, pool, name, problems, prompts, config)
                (out_dir / "records" / name).parent.mkdir(parents=True, exist_ok=True)  # mmlu/<subject>
                with open(out_dir / "records" / f"{name}.jsonl", "w") as f:
                    f.writelines(json.dumps(r) + "\n" for r in records)
    finally:
        if own_engine:
            engine.close()
    results |= pool_subjects(results)
    settings = {k: v for k, v in asdict(config).items() if k != "sampling"}
    payload = {
        "model": config.model,
        "config": settings,
        "extraction": {name: config.extraction_for(name) for name in results},
        "results": results,
        "seconds": time.perf_counter() - start,
    }
    (out_dir / "results.json").write_text(json.dumps(payload, indent=2) + "\n")
    label = config.label or Path(config.model).name
    (out_dir / "results.md").write_text(markdown_report(label, results, config.ks))
    return payload
