"""The local data sets: their folders, Hugging Face sources and row rules, and the hub loading they share.

:data:`BENCHMARKS` is the one table of the sets ``gtpo-data`` materialises and ``load_problems`` reads from the data
folder; :func:`load_hub_rows` is the one place that calls ``datasets.load_dataset``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gtpo_megatron.data import openr1
from gtpo_megatron.data.mmlu import MMLU, is_mmlu, mmlu_problem, subject_of
from gtpo_megatron.data.openr1 import OPENR1_MATH, openr1_problem

if TYPE_CHECKING:
    from gtpo_megatron.data.types import Problem

RecordReader = Callable[..., "Problem | str"]
"""``reader(record, *, default_id, where) -> Problem`` or the name of the reason the row is dropped."""


@dataclass(frozen=True)
class Benchmark:
    """A local data set: its folder under the data directory, its Hugging Face source and its row format.

    ``splits`` maps each local split (the first is the default) to the hub's split name; ``hub_config`` is the
    dataset's config name (None: the default one). ``fields``: the row fields ``gtpo-data`` keeps (None: the
    question and answer fields of :data:`QUESTION_KEYS` / :data:`ANSWER_KEYS`); ``reader``: the row -> problem rule
    (None: the generic one, :func:`record_to_problem`).
    """

    folder: str
    hub_name: str
    hub_config: str | None
    splits: dict[str, str]
    fields: tuple[str, ...] | None = None
    reader: RecordReader | None = None


BENCHMARKS = {
    "gsm8k": Benchmark("gsm8k", "openai/gsm8k", "main", {"train": "train", "test": "test"}),
    "math500": Benchmark("math500", "HuggingFaceH4/MATH-500", None, {"test": "test"}),
    "aime24": Benchmark("aime24", "HuggingFaceH4/aime_2024", None, {"test": "train"}),
    "aime25": Benchmark("aime25", "math-ai/aime25", None, {"test": "test"}),
    "amc23": Benchmark("amc2023", "math-ai/amc23", None, {"test": "test"}),
    MMLU: Benchmark(
        "mmlu",
        "cais/mmlu",
        "all",
        {"test": "test", "validation": "validation", "dev": "dev"},
        ("question", "choices", "answer", "subject"),
        mmlu_problem,
    ),
    OPENR1_MATH: Benchmark(
        "openr1-math", "open-r1/OpenR1-Math-220k", "default", {"train": "train"}, openr1.FIELDS, openr1_problem
    ),
}
HF_ALIASES = {"math": "DigitalLearningGmbH/MATH-lighteval"}
QUESTION_KEYS = ("question", "problem", "prompt")
ANSWER_KEYS = ("answer", "solution", "final_answer")


def hub_dataset(name: str, split: str) -> tuple[str, str | None, str]:
    """``(hub name, config, hub split)`` to load for the source ``name`` and the local ``split``.

    A local benchmark name or its hub name (``gsm8k``, ``openai/gsm8k``) gets the config and split naming of
    :data:`BENCHMARKS`; ``math`` is MATH-lighteval; any other name is loaded as it is.
    """
    for benchmark_name, benchmark in BENCHMARKS.items():
        if name in (benchmark_name, benchmark.hub_name):
            return benchmark.hub_name, benchmark.hub_config, benchmark.splits.get(split, split)
    return HF_ALIASES.get(name, name), None, split


def local_key(source: str, *, field: str = "source") -> str:
    """The :data:`BENCHMARKS` key of ``source``: ``mmlu`` for ``mmlu/<subject>``, else ``source`` itself.

    Raises:
        ValueError: an MMLU subject that does not exist (names ``field`` and the closest subjects).
    """
    if is_mmlu(source):
        try:
            subject_of(source)
        except ValueError as err:
            raise ValueError(f"{field}={err}") from None
        return MMLU
    return source


def load_hub_rows(name: str, *, split: str) -> Any:
    """The rows of a Hugging Face dataset split (``hub_dataset`` naming), through ``datasets`` (imported lazily).

    Raises:
        RuntimeError: ``datasets`` is not installed, or the download failed (offline, unknown name): the message
            names the dataset, the error and the offline alternatives.
    """
    try:
        import datasets
    except ImportError as exc:
        raise RuntimeError(
            f"data source {name!r} is a Hugging Face dataset and needs the `datasets` package "
            "(pip install datasets) plus network access or a warm HF cache; offline, use a local jsonl via "
            "path=... or the built-in 'synthetic' source"
        ) from exc
    hub_name, config, hub_split = hub_dataset(name, split)
    try:
        return datasets.load_dataset(hub_name, config, split=hub_split)
    except Exception as exc:  # noqa: BLE001 - datasets raises many kinds (connection, offline mode, missing split)
        raise RuntimeError(
            f"could not load the Hugging Face dataset {hub_name!r} (config {config}, split {hub_split!r}): "
            f"{type(exc).__name__}: {exc}. It needs network access or a warm HF cache; offline, run `gtpo-data` "
            "on a machine that is online and copy its folder here (GTPO_DATA_DIR), or pass a local jsonl"
        ) from exc
