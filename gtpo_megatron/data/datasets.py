r"""Problem sets: local jsonl files, Hugging Face datasets and the built-in synthetic task, as :class:`Problem`.

``Problem.answer`` is the *final* reference answer (``"72"``, ``"\\frac{14}{3}"``), ready for the rewards. Local
sets (:data:`~gtpo_megatron.data.benchmarks.BENCHMARKS`, in :func:`default_data_dir`, written by ``gtpo-data``):

==============  ==============================  =============================  =================================
source          file                            fields                         answer
==============  ==============================  =============================  =================================
gsm8k           gsm8k/{train,test}.jsonl        question, answer               after ``####``, commas removed
math500, aime*  <folder>/test.jsonl             problem, answer                as is
mmlu[/subject]  mmlu/{test,validation,dev}      question, choices, answer      letter + choices (:mod:`.mmlu`)
openr1-math     openr1-math/train.jsonl         problem, answer, correctness_  as is, unusable rows dropped
                                                                               (:mod:`.openr1`)
==============  ==============================  =============================  =================================

The benchmarks' "Please reason step by step, and put your final answer within \\boxed{}." is removed: the system
prompt asks for the ``<answer>`` block instead. Other sources: ``synthetic`` (no download), ``math``
(``DigitalLearningGmbH/MATH-lighteval``, answer = last ``\\boxed{}``), or any Hugging Face name with a
question/problem/prompt and an answer/solution field (needs ``datasets`` and network or its cache).
"""

from __future__ import annotations

import difflib
import functools
import importlib.util
import json
import logging
import os
import warnings
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gtpo_megatron.builtin_models import cache_dir
from gtpo_megatron.data.benchmarks import (
    ANSWER_KEYS,
    BENCHMARKS,
    HF_ALIASES,
    QUESTION_KEYS,
    RecordReader,
    load_hub_rows,
    local_key,
)
from gtpo_megatron.data.mmlu import is_mmlu, subject_of
from gtpo_megatron.data.types import Problem
from gtpo_megatron.rewards.answer_text import reference_answer

if TYPE_CHECKING:
    from gtpo_megatron.data.synthetic import SyntheticLevel

logger = logging.getLogger(__name__)
_BOXED_SUFFIX = "Please reason step by step, and put your final answer within \\boxed{}."


SYNTHETIC_DEFAULT_SIZE = 2000


def default_data_dir() -> Path:
    """Where the benchmark folders are read from: the folder ``gtpo-data`` writes by default."""
    return default_download_dir()


def default_download_dir() -> Path:
    """Where ``gtpo-data`` writes by default: ``$GTPO_DATA_DIR``, else ``data/`` in the model cache folder."""
    env = os.environ.get("GTPO_DATA_DIR")
    return Path(env) if env else cache_dir() / "data"


def record_to_problem(record: Any, *, source: str, default_id: str, where: str) -> Problem:
    """The generic rule: validates one record and builds its :class:`Problem`; ``where`` names it in errors."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    question_key = next((k for k in QUESTION_KEYS if k in record), None)
    answer_key = next((k for k in ANSWER_KEYS if k in record), None)
    if question_key is None or answer_key is None:
        missing = "question (one of question/problem/prompt)" if question_key is None else "answer (answer/solution)"
        raise ValueError(f"{where}: missing field {missing}; fields present: {sorted(record)}")
    question = str(record[question_key]).removesuffix(_BOXED_SUFFIX).strip()
    answer = reference_answer(str(record[answer_key]))
    if not question or not answer:
        raise ValueError(f"{where}: field {question_key if not question else answer_key!r} is empty")
    problem_id = str(record.get("id", record.get("unique_id", default_id)))
    return Problem(id=problem_id, question=question, answer=answer, source=source)


def _reader(source: str) -> RecordReader:
    """The row rule of ``source``: its benchmark's ``reader``, else :func:`record_to_problem`."""
    benchmark = BENCHMARKS.get(local_key(source))
    if benchmark is not None and benchmark.reader is not None:
        return benchmark.reader
    return functools.partial(record_to_problem, source=source)


def _to_problems(rows: Iterable[tuple[str, str, Any]], *, source: str, limit: int | None, origin: str) -> list[Problem]:
    """``(where, default_id, record)`` rows as problems through ``source``'s reader, up to ``limit`` problems.

    Rows the reader drops are counted by reason and logged once (``origin`` names the file or dataset); an
    ``mmlu/<subject>`` source keeps that subject's rows only.

    Raises:
        ValueError: a repeated ``id``, the reader's errors, or a subject with no rows in ``origin``.
    """
    reader, subject = _reader(source), subject_of(source) if is_mmlu(source) else None
    problems: list[Problem] = []
    seen_ids: set[str] = set()
    drops: Counter[str] = Counter()
    for where, default_id, record in rows:
        if limit is not None and len(problems) >= limit:
            break
        problem = reader(record, default_id=default_id, where=where)
        if isinstance(problem, str):
            drops[problem] += 1
            continue
        if subject is not None and problem.source != source:
            continue
        if problem.id in seen_ids:
            raise ValueError(f"{where}: duplicate id {problem.id!r}; ids must be unique within a file")
        seen_ids.add(problem.id)
        problems.append(problem)
    if drops:
        counts = ", ".join(f"{reason} {n}" for reason, n in sorted(drops.items()))
        logger.warning("%s: dropped %d rows (%s); kept %d problems", origin, drops.total(), counts, len(problems))
    if subject is not None and not problems:
        raise ValueError(f"{origin} holds no question of the MMLU subject {subject!r}; run `gtpo-data mmlu` for all")
    return problems


def _jsonl_rows(path: Path, id_prefix: str) -> Iterable[tuple[str, str, Any]]:
    with path.open(encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: malformed JSON ({exc.msg} at column {exc.colno})") from exc
            yield where, f"{id_prefix}-{path.stem}-{line_no - 1}", record


def read_jsonl(path: str | Path, *, source: str, limit: int | None = None) -> list[Problem]:
    """Reads a jsonl file of problems with ``source``'s row rule (module docstring), stopping after ``limit``.

    Raises:
        FileNotFoundError: if ``path`` does not exist (the message says how to point at the data).
        ValueError: on a malformed line, a missing/empty field or a repeated ``id``; the message names the file and
            line number.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no such data file; pass path=... (data.path in configs) or set GTPO_DATA_DIR to the folder "
            "that holds gsm8k/, math500/, aime24/, aime25/, amc2023/, mmlu/ (`gtpo-data --out DIR` downloads them)"
        )
    return _to_problems(_jsonl_rows(path, local_key(source)), source=source, limit=limit, origin=str(path))


def _load_hf(name: str, *, split: str, limit: int | None) -> list[Problem]:
    """A Hugging Face dataset split as problems (:func:`load_hub_rows`, then the jsonl rules per row)."""
    rows = load_hub_rows(name, split=split)
    source = next((key for key, b in BENCHMARKS.items() if name == b.hub_name), name.split("/")[-1])
    indexed = ((f"{name}[{split}][{i}]", f"{source}-{i}", row) for i, row in enumerate(rows))
    return _to_problems(indexed, source=source, limit=limit, origin=f"{name}[{split}]")


def check_source(
    source: str,
    *,
    path: str | None = None,
    split: str | None = None,
    data_dir: str | None = None,
    prefix: str = "",
    data_dir_flag: str | None = None,
) -> None:
    """Fails fast, without reading any data, when ``load_problems`` with these arguments cannot find its data.

    Checks that ``path`` exists, that a local benchmark has ``split`` and its file, and that any other source is a
    Hugging Face name that the installed packages can load. ``prefix`` is put before the field names in messages
    (``"data."`` for the training config). ``data_dir_flag``: the caller's option for the data folder, for a caller
    without a file option (gtpo-eval: ``--data-dir``); the messages name it instead of ``{prefix}path=FILE.jsonl``.

    Raises:
        ValueError: naming the field, its value and a fix.
    """
    key = local_key(source, field=f"{prefix}source")
    point_at_dir = (
        f"pass {data_dir_flag} DIR or set GTPO_DATA_DIR=DIR"
        if data_dir_flag
        else f"set GTPO_DATA_DIR=DIR, or give {prefix}path=FILE.jsonl"
    )
    if path is not None:
        if not Path(path).is_file():
            raise ValueError(
                f"{prefix}path={str(path)!r}: no such file; give an existing jsonl file or "
                f"{prefix}path=null to use the {prefix}source's default data"
            )
        return
    if source == "synthetic":
        return
    if key in BENCHMARKS:
        splits = list(BENCHMARKS[key].splits)
        split = split or splits[0]
        if split not in splits:
            raise ValueError(
                f"{prefix}split={split!r}: {source!r} has only the split(s) {splits}; use {prefix}split={splits[0]}"
            )
        file = (Path(data_dir) if data_dir else default_data_dir()) / BENCHMARKS[key].folder / f"{split}.jsonl"
        if not file.is_file():
            raise ValueError(
                f"{prefix}source={source!r}: {file} does not exist; download the benchmarks once with "
                f"`gtpo-data --out DIR {key}` (needs `pip install datasets` and network) and {point_at_dir}"
            )
        return
    if importlib.util.find_spec("datasets") is None:
        known = ["synthetic", *BENCHMARKS]
        near = difflib.get_close_matches(source, known, n=1) if source not in HF_ALIASES else []
        what = f"the Hugging Face dataset {HF_ALIASES[source]!r}" if source in HF_ALIASES else "not a local source"
        local = f"a local source ({data_dir_flag} DIR)" if data_dir_flag else f"a local jsonl, {prefix}path=FILE.jsonl"
        fix = f"did you mean {near[0]!r}? Otherwise use {local}" if near else f"use one of {known} or {local}"
        raise ValueError(
            f"{prefix}source={source!r}: {what}, and loading it from Hugging Face needs the `datasets` "
            f"package, which is not installed (pip install datasets); {fix}"
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
        source: a key of :data:`BENCHMARKS`, ``mmlu/<subject>``, synthetic, math (HF) or a Hugging Face name.
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
    key = local_key(source)
    if key in BENCHMARKS:
        splits = list(BENCHMARKS[key].splits)
        split = split or splits[0]
        if split not in splits:
            raise ValueError(f"split={split!r} does not exist for {source!r}; available splits: {splits}")
        base = Path(data_dir) if data_dir else default_data_dir()
        return read_jsonl(base / BENCHMARKS[key].folder / f"{split}.jsonl", source=source, limit=limit)
    return _load_hf(source, split=split or "train", limit=limit)
