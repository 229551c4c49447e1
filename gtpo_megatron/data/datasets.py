r"""Problem sets: local jsonl benchmarks, Hugging Face datasets and the built-in synthetic task.

Every example becomes a :class:`Problem` ``(id, question, answer, source)`` where ``answer`` is the *final*
reference answer (``"72"``, ``"\\frac{14}{3}"``), ready for :mod:`gtpo_megatron.rewards`.

Local files (default directory ``$GTPO_DATA_DIR``, else ``<repo>/../shared/data``; fields checked on every line):

==========  =========================  ====================  =============================================
source      file                       fields                answer
==========  =========================  ====================  =============================================
gsm8k       gsm8k/{train,test}.jsonl   question, answer      text after ``####``, commas removed
math500     math500/test.jsonl         problem, answer       as is
aime24      aime24/test.jsonl          problem, answer       as is
aime25      aime25/test.jsonl          problem, answer       as is
amc23       amc2023/test.jsonl         problem, answer       as is
==========  =========================  ====================  =============================================

The benchmark files end each problem with "Please reason step by step, and put your final answer within
\\boxed{}."; that sentence is removed, because the system prompt (:mod:`gtpo_megatron.data.prompts`) asks for the
paper's ``<answer>`` block instead (a ``\\boxed{}`` inside it is still understood by the rewards).

Other sources: ``synthetic`` (:mod:`gtpo_megatron.data.synthetic`, no download), ``math`` (Hugging Face
``DigitalLearningGmbH/MATH-lighteval``, answer = last ``\\boxed{}`` of the solution), or any Hugging Face dataset
name with a question field (question/problem/prompt) and an answer field (answer/solution); those need the
``datasets`` package and network access (or its cache).
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gtpo_megatron.data.types import Problem
from gtpo_megatron.rewards.answer_text import reference_answer

if TYPE_CHECKING:
    from gtpo_megatron.data.synthetic import SyntheticLevel

_BOXED_SUFFIX = "Please reason step by step, and put your final answer within \\boxed{}."
_LOCAL_FILES = {
    "gsm8k": ("gsm8k", ("train", "test")),
    "math500": ("math500", ("test",)),
    "aime24": ("aime24", ("test",)),
    "aime25": ("aime25", ("test",)),
    "amc23": ("amc2023", ("test",)),
}
_HF_ALIASES = {"math": "DigitalLearningGmbH/MATH-lighteval"}
_QUESTION_KEYS = ("question", "problem", "prompt")
_ANSWER_KEYS = ("answer", "solution", "final_answer")
SYNTHETIC_DEFAULT_SIZE = 2000


def default_data_dir() -> Path:
    """``$GTPO_DATA_DIR`` if set, else ``../shared/data`` next to the repository root."""
    env = os.environ.get("GTPO_DATA_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2].parent / "shared" / "data"


def _record_to_problem(record: Any, *, source: str, default_id: str, where: str) -> Problem:
    """Validates one record and builds its :class:`Problem`; ``where`` names the file and line for errors."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    question_key = next((k for k in _QUESTION_KEYS if k in record), None)
    answer_key = next((k for k in _ANSWER_KEYS if k in record), None)
    if question_key is None or answer_key is None:
        missing = "question (one of question/problem/prompt)" if question_key is None else "answer (answer/solution)"
        raise ValueError(f"{where}: missing field {missing}; fields present: {sorted(record)}")
    question = str(record[question_key]).removesuffix(_BOXED_SUFFIX).strip()
    answer = reference_answer(str(record[answer_key]))
    if not question or not answer:
        raise ValueError(f"{where}: field {question_key if not question else answer_key!r} is empty")
    problem_id = str(record.get("id", record.get("unique_id", default_id)))
    return Problem(id=problem_id, question=question, answer=answer, source=source)


def read_jsonl(path: str | Path, *, source: str, limit: int | None = None) -> list[Problem]:
    """Reads a jsonl file of problems (fields as in the module docstring), stopping after ``limit`` problems.

    Raises:
        FileNotFoundError: if ``path`` does not exist (the message says how to point at the data).
        ValueError: on a malformed line, a missing/empty field or a repeated ``id``; the message names the file and
            line number.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no such data file; pass path=... (data.path in configs) or set GTPO_DATA_DIR to the folder "
            "that holds gsm8k/, math500/, aime24/, aime25/, amc2023/"
        )
    problems: list[Problem] = []
    seen_ids: set[str] = set()
    with path.open(encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if limit is not None and len(problems) >= limit:
                break
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: malformed JSON ({exc.msg} at column {exc.colno})") from exc
            problem = _record_to_problem(
                record, source=source, default_id=f"{source}-{path.stem}-{line_no - 1}", where=where
            )
            if problem.id in seen_ids:
                raise ValueError(f"{where}: duplicate id {problem.id!r}; ids must be unique within a file")
            seen_ids.add(problem.id)
            problems.append(problem)
    return problems


def _load_hf(name: str, *, split: str, limit: int | None) -> list[Problem]:
    """Loads a Hugging Face dataset split through ``datasets`` (imported lazily).

    Raises:
        RuntimeError: if ``datasets`` is not installed.
    """
    try:
        import datasets
    except ImportError as exc:
        raise RuntimeError(
            f"data source {name!r} is a Hugging Face dataset and needs the `datasets` package "
            "(pip install datasets) plus network access or a warm HF cache; offline, use a local jsonl via "
            "path=... or the built-in 'synthetic' source"
        ) from exc
    rows = datasets.load_dataset(_HF_ALIASES.get(name, name), split=split)
    count = len(rows) if limit is None else min(limit, len(rows))
    source = name.split("/")[-1]
    return [
        _record_to_problem(rows[i], source=source, default_id=f"{source}-{i}", where=f"{name}[{split}][{i}]")
        for i in range(count)
    ]


def check_source(
    source: str, *, path: str | None = None, split: str | None = None, data_dir: str | None = None, prefix: str = ""
) -> None:
    """Fails fast, without reading any data, when ``load_problems`` with these arguments cannot find its data.

    Checks that ``path`` exists, that a local benchmark has ``split`` and its file, and that any other source is a
    Hugging Face name that the installed packages can load. ``prefix`` is put before the field names in messages
    (``"data."`` for the training config).

    Raises:
        ValueError: naming the field, its value and a fix.
    """
    if path is not None:
        if not Path(path).is_file():
            raise ValueError(
                f"{prefix}path={str(path)!r}: no such file; give an existing jsonl file or "
                f"{prefix}path=null to use the {prefix}source's default data"
            )
        return
    if source == "synthetic":
        return
    if source in _LOCAL_FILES:
        folder, splits = _LOCAL_FILES[source]
        split = split or splits[0]
        if split not in splits:
            raise ValueError(
                f"{prefix}split={split!r}: {source!r} has only the split(s) {list(splits)}; "
                f"use {prefix}split={splits[0]}"
            )
        file = (Path(data_dir) if data_dir else default_data_dir()) / folder / f"{split}.jsonl"
        if not file.is_file():
            raise ValueError(
                f"{prefix}source={source!r}: {file} does not exist; point GTPO_DATA_DIR (gtpo-eval: "
                "--data-dir) at the folder that holds gsm8k/, math500/, aime24/, aime25/, amc2023/, or "
                f"give {prefix}path=FILE.jsonl"
            )
        return
    if importlib.util.find_spec("datasets") is None:
        known = ["synthetic", *_LOCAL_FILES]
        near = difflib.get_close_matches(source, known, n=1) if source not in _HF_ALIASES else []
        fix = f"did you mean {near[0]!r}? Otherwise" if near else f"use one of {known} or"
        what = f"the Hugging Face dataset {_HF_ALIASES[source]!r}" if source in _HF_ALIASES else "not a local source"
        raise ValueError(
            f"{prefix}source={source!r}: {what}, and loading it from Hugging Face needs the `datasets` "
            f"package, which is not installed (pip install datasets); {fix} give a local jsonl with "
            f"{prefix}path=FILE.jsonl"
        )


def load_problems(
    source: str,
    *,
    path: str | None = None,
    split: str | None = None,
    limit: int | None = None,
    data_dir: str | None = None,
    seed: int = 0,
    difficulty: str | SyntheticLevel = "easy",
) -> list[Problem]:
    """Loads a problem set as a list of :class:`Problem` in file order.

    Args:
        source: gsm8k, math500, aime24, aime25, amc23, synthetic, math (HF) or a Hugging Face dataset name.
        path: explicit jsonl file (overrides ``data_dir``/``split`` lookup); read with ``source``'s rules.
        split: ``train`` or ``test``; ``None`` means ``train`` where the source has one, else ``test``.
        limit: keep at most this many problems (the first ones).
        data_dir: folder holding the benchmark folders (default :func:`default_data_dir`).
        seed: synthetic only: generator seed.
        difficulty: synthetic only: a key of ``gtpo_megatron.data.synthetic.SYNTHETIC_LEVELS`` or a
            ``SyntheticLevel``.

    Raises:
        ValueError: on an unknown split, a negative ``limit``, or a malformed file (names the file and line).
        FileNotFoundError: if the jsonl file is missing.
        RuntimeError: for a Hugging Face name when ``datasets`` is not installed.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit={limit} must be >= 0 or None (all problems)")
    if source != "synthetic" and (seed != 0 or difficulty != "easy"):
        warnings.warn(f"seed/difficulty only apply to the 'synthetic' source, not {source!r}; ignored", stacklevel=2)
    if path is not None:
        return read_jsonl(path, source=source, limit=limit)
    if source == "synthetic":
        from gtpo_megatron.data.synthetic import generate_problems

        num = SYNTHETIC_DEFAULT_SIZE if limit is None else limit
        return generate_problems(num, seed=seed, split=split or "train", difficulty=difficulty)
    if source in _LOCAL_FILES:
        folder, splits = _LOCAL_FILES[source]
        split = split or splits[0]
        if split not in splits:
            raise ValueError(f"split={split!r} does not exist for {source!r}; available splits: {list(splits)}")
        base = Path(data_dir) if data_dir else default_data_dir()
        return read_jsonl(base / folder / f"{split}.jsonl", source=source, limit=limit)
    return _load_hf(source, split=split or "train", limit=limit)
