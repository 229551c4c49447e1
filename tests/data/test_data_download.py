"""``gtpo-data`` (``data.download``) with a stand-in ``datasets`` module: the jsonl layout it writes loads with the
right answers; offline or without ``datasets`` it exits 2 with a clear message; the data folder's defaults."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from gtpo_megatron.data import datasets as data_sets
from gtpo_megatron.data import load_problems
from gtpo_megatron.data.download import DEFAULT_SOURCES, main
from gtpo_megatron.rewards.choice import read_choice_reference

FIXTURES = Path(__file__).parent / "fixtures"

HUB_ROWS = {  # (name, config, split) -> rows, shaped like the real datasets' columns
    ("openai/gsm8k", "main", "train"): [{"question": "2+3?", "answer": "2+3=5\n#### 5"}],
    ("openai/gsm8k", "main", "test"): [
        {"question": "Janet's ducks?", "answer": "16-3-4=9, 9*2=18\n#### 18"},
        {"question": "A robe?", "answer": "#### 1,234"},
    ],
    ("HuggingFaceH4/aime_2024", None, "train"): [
        {"id": 60, "problem": "Every morning Aya...", "solution": "... so $\\boxed{204}$", "answer": "204"}
    ],
    ("math-ai/amc23", None, "test"): [{"id": 0, "question": "Cities $A$ and $B$?", "answer": 27.0}],
}


@pytest.fixture
def hub(monkeypatch):
    """A ``datasets`` module serving ``HUB_ROWS``; ``hub.calls`` records every load."""
    calls = []

    def load_dataset(name, config=None, *, split):
        calls.append((name, config, split))
        return HUB_ROWS[(name, config, split)]

    module = types.SimpleNamespace(load_dataset=load_dataset, calls=calls)
    monkeypatch.setitem(sys.modules, "datasets", module)
    return module


def test_gtpo_data_writes_the_layout_the_loader_reads(hub, tmp_path, capsys):
    assert main(["--out", str(tmp_path), "gsm8k", "aime24", "amc23"]) == 0
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.jsonl")) == [
        "aime24/test.jsonl",
        "amc2023/test.jsonl",
        "gsm8k/test.jsonl",
        "gsm8k/train.jsonl",
    ]
    assert hub.calls == [
        ("openai/gsm8k", "main", "train"),
        ("openai/gsm8k", "main", "test"),
        ("HuggingFaceH4/aime_2024", None, "train"),  # AIME 2024's only hub split is our test split
        ("math-ai/amc23", None, "test"),
    ]
    answers = {
        source: [p.answer for p in load_problems(source, split=split, data_dir=str(tmp_path))]
        for source, split in (("gsm8k", "train"), ("gsm8k", "test"), ("aime24", None), ("amc23", None))
    }
    assert answers == {"gsm8k": ["18", "1234"], "aime24": ["204"], "amc23": ["27"]}  # the dict keeps the test split
    assert [p.answer for p in load_problems("gsm8k", split="train", data_dir=str(tmp_path))] == ["5"]
    assert load_problems("aime24", data_dir=str(tmp_path))[0].id == "60"
    out = capsys.readouterr().out
    assert f"{tmp_path}/gsm8k/test.jsonl: 2 problems" in out and f"export GTPO_DATA_DIR={tmp_path}" in out
    assert main(["--out", str(tmp_path), "gsm8k"]) == 0 and len(hub.calls) == 4  # kept: no second download
    assert main(["--out", str(tmp_path), "--force", "gsm8k"]) == 0 and len(hub.calls) == 6


def test_gtpo_data_offline_or_without_datasets_fails_clearly(monkeypatch, tmp_path, capsys):
    def offline(name, config=None, *, split):
        raise ConnectionError(f"Couldn't reach 'https://huggingface.co/datasets/{name}'")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=offline))
    assert main(["--out", str(tmp_path), "math500"]) == 2
    err = capsys.readouterr().err
    assert "gtpo-data: could not load the Hugging Face dataset 'HuggingFaceH4/MATH-500'" in err
    assert "ConnectionError" in err and "network access" in err
    assert list(tmp_path.rglob("*")) == []  # nothing half written
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    assert main(["--out", str(tmp_path), "gsm8k"]) == 2
    assert "needs the `datasets` package (pip install datasets)" in capsys.readouterr().err
    assert main(["--out", str(tmp_path), "gsm9k"]) == 2
    assert "unknown benchmark 'gsm9k'" in capsys.readouterr().err


def test_data_folder_defaults(monkeypatch, tmp_path):
    monkeypatch.setenv("GTPO_DATA_DIR", str(tmp_path / "mine"))
    assert data_sets.default_data_dir() == data_sets.default_download_dir() == tmp_path / "mine"
    monkeypatch.delenv("GTPO_DATA_DIR")
    monkeypatch.setenv("GTPO_CACHE_DIR", str(tmp_path / "cache"))
    assert data_sets.default_data_dir() == data_sets.default_download_dir() == tmp_path / "cache" / "data"
    with pytest.raises(ValueError, match=r"gsm8k/train.jsonl does not exist; download the benchmarks once with "
                       r"`gtpo-data --out DIR gsm8k`"):  # fmt: skip
        data_sets.check_source("gsm8k", data_dir=str(tmp_path / "empty"))


def test_gtpo_data_writes_mmlu_and_openr1_math_with_their_fields(hub, tmp_path, capsys, caplog, monkeypatch):
    """MMLU keeps choices and subject (answers are the hub's class indices), OpenR1-Math its verification fields;
    both load back through their row rules, and the unverified R1 row is dropped and counted."""
    mmlu_row = {"question": "2+2?", "subject": "elementary_mathematics", "choices": ["3", "4", "5", "6"], "answer": 1}
    r1_rows = [json.loads(x) for x in (FIXTURES / "openr1-math" / "train.jsonl").read_text().splitlines()[:4]]
    for split in ("test", "validation", "dev"):
        monkeypatch.setitem(HUB_ROWS, ("cais/mmlu", "all", split), [mmlu_row])
    monkeypatch.setitem(HUB_ROWS, ("open-r1/OpenR1-Math-220k", "default", "train"), r1_rows)
    assert main(["--out", str(tmp_path), "mmlu", "openr1-math"]) == 0
    assert json.loads((tmp_path / "mmlu" / "dev.jsonl").read_text()) == {"id": "mmlu-dev-0", **mmlu_row}
    written = json.loads((tmp_path / "openr1-math" / "train.jsonl").read_text().splitlines()[1])
    assert sorted(written) == sorted(["id", "uuid", "problem", "answer", "question_type", "correctness_math_verify",
                                      "correctness_llama"])  # fmt: skip
    problems = load_problems("mmlu/elementary_mathematics", data_dir=str(tmp_path))
    assert [read_choice_reference(p.answer).letter for p in problems] == ["B"]
    assert [p.id for p in load_problems("openr1-math", data_dir=str(tmp_path))] == ["r1-a", "r1-b"]
    assert f"{tmp_path}/openr1-math/train.jsonl: 2 problems" in capsys.readouterr().out
    assert "dropped 2 rows (no_final_answer 1, unverified 1); kept 2 problems" in caplog.text
    assert "openr1-math" not in DEFAULT_SOURCES and "mmlu" in DEFAULT_SOURCES  # the 220k-row set only on request
