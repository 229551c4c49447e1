"""jsonl readers for the benchmark files, error messages naming file and line, Hugging Face sources."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from gtpo_megatron.data import default_data_dir, load_problems, read_jsonl
from tests.helpers.data import needs_benchmark_data

needs_data = needs_benchmark_data(
    "gsm8k/train.jsonl",
    "gsm8k/test.jsonl",
    "math500/test.jsonl",
    "aime24/test.jsonl",
    "aime25/test.jsonl",
    "amc2023/test.jsonl",
)


@needs_data
@pytest.mark.parametrize(
    ("source", "split", "count", "first_answer"),
    [
        ("gsm8k", "train", 7473, "72"),
        ("gsm8k", "test", 1319, "18"),
        ("math500", None, 500, "\\left( 3, \\frac{\\pi}{2} \\right)"),
        ("aime24", None, 30, "204"),
        ("aime25", None, 30, "70"),
        ("amc23", None, 40, "27"),
    ],
)
def test_local_files_load_with_final_answers(source: str, split: str | None, count: int, first_answer: str) -> None:
    problems = load_problems(source, split=split)
    assert len(problems) == count
    assert problems[0].answer == first_answer
    assert len({p.id for p in problems}) == count
    assert all(p.source == source and p.question and p.answer for p in problems)
    assert not any("put your final answer within" in p.question for p in problems)
    assert all("####" not in p.answer and "," not in p.answer for p in problems if source == "gsm8k")


@needs_data
def test_gsm8k_answer_is_the_text_after_hashes() -> None:
    first = json.loads((default_data_dir() / "gsm8k" / "train.jsonl").read_text().splitlines()[0])
    problem = load_problems("gsm8k", limit=1)[0]
    assert problem.question == first["question"]
    assert first["answer"].endswith("#### 72") and problem.answer == "72"


@needs_data
def test_limit_split_and_missing_files(tmp_path: Path) -> None:
    assert [p.id for p in load_problems("gsm8k", split="test", limit=3)] == [f"gsm8k-test-{i}" for i in range(3)]
    with pytest.raises(ValueError, match="split='train' does not exist for 'aime24'; available splits: \\['test'\\]"):
        load_problems("aime24", split="train")
    with pytest.raises(FileNotFoundError, match="nowhere.*GTPO_DATA_DIR"):
        load_problems("math500", data_dir=str(tmp_path / "nowhere"))


def _write(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_malformed_line_names_file_and_line(tmp_path: Path) -> None:
    path = _write(tmp_path, ['{"question": "1+1?", "answer": "#### 2"}', '{"question": "2+2?", "answer": 4'])
    with pytest.raises(ValueError, match=f"{path}:2: malformed JSON"):
        read_jsonl(path, source="gsm8k")


def test_missing_field_names_file_line_and_field(tmp_path: Path) -> None:
    path = _write(tmp_path, ['{"problem": "x?", "answer": "1"}', "", '{"problem": "y?", "reply": "2"}'])
    with pytest.raises(ValueError, match=f"{path}:3: missing field answer .*fields present: \\['problem', 'reply'\\]"):
        load_problems("math500", path=str(path))
    path = _write(tmp_path, ['["not", "an", "object"]'])
    with pytest.raises(ValueError, match=f"{path}:1: expected a JSON object, got list"):
        read_jsonl(path, source="aime24")


def test_custom_file_reduces_solutions_to_final_answers(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        [
            '{"question": "a?", "answer": "so 1,000 + 234 = 1,234\\n#### 1,234"}',
            '{"problem": "b?", "solution": "thus $\\\\boxed{\\\\frac{1}{2}}$.", "id": "b-7"}',
        ],
    )
    problems = read_jsonl(path, source="mine")
    assert [(p.id, p.answer) for p in problems] == [("mine-bad-0", "1234"), ("b-7", "\\frac{1}{2}")]


def test_hugging_face_name_without_datasets_is_a_clear_runtime_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(RuntimeError, match="needs the `datasets` package"):
        load_problems("openai/gsm8k")


def test_synthetic_source_and_argument_checks(tmp_path: Path) -> None:
    problems = load_problems("synthetic", limit=4, seed=3)
    assert len(problems) == 4 and all(p.source == "synthetic" for p in problems)
    assert load_problems("synthetic", limit=4, seed=3) == problems
    assert load_problems("synthetic", limit=4, seed=4) != problems
    with pytest.raises(ValueError, match="limit=-1"):
        load_problems("synthetic", limit=-1)
    path = _write(tmp_path, ['{"problem": "x?", "answer": "1"}'])
    with pytest.warns(UserWarning, match="only apply to the 'synthetic' source"):
        assert len(load_problems("aime24", path=str(path), seed=1)) == 1


def test_duplicate_ids_and_empty_fields_are_rejected(tmp_path: Path) -> None:
    lines = ['{"id": "a", "problem": "x?", "answer": "1"}', '{"id": "a", "problem": "y?", "answer": "2"}']
    path = _write(tmp_path, lines)
    with pytest.raises(ValueError, match=f"{path}:2: duplicate id 'a'"):
        read_jsonl(path, source="mine")
    path = _write(tmp_path, ['{"question": "x?", "answer": "  "}'])
    with pytest.raises(ValueError, match=f"{path}:1: field 'answer' is empty"):
        read_jsonl(path, source="gsm8k")


def test_hugging_face_rows_are_read_with_the_same_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, str]] = []

    def load_dataset(name: str, config: str | None = None, *, split: str) -> list[dict[str, str]]:
        calls.append((name, config, split))
        return [
            {"problem": "p0?", "solution": "so $\\boxed{\\frac{1}{2}}$"},
            {"problem": "p1?", "solution": "\\boxed{3}"},
        ]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    problems = load_problems("math", limit=1)
    assert calls == [("DigitalLearningGmbH/MATH-lighteval", None, "train")]
    assert [(p.id, p.question, p.answer, p.source) for p in problems] == [("math-0", "p0?", "\\frac{1}{2}", "math")]
    assert [p.answer for p in load_problems("someone/set", split="test")] == ["\\frac{1}{2}", "3"]
    assert calls[-1] == ("someone/set", None, "test")
    load_problems("openai/gsm8k", split="test")  # a benchmark's hub name: its config, its split names
    assert calls[-1] == ("openai/gsm8k", "main", "test")
