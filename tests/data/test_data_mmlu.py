"""MMLU as a data source: the fixture (cais/mmlu's fields) as lettered problems, subject selection, bad rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gtpo_megatron.data import load_problems
from gtpo_megatron.data.datasets import check_source
from gtpo_megatron.data.mmlu import SUBJECTS
from gtpo_megatron.rewards.choice import read_choice_reference

FIXTURES = str(Path(__file__).parent / "fixtures")


def test_rows_become_lettered_questions_with_letter_answers():
    problems = load_problems("mmlu", data_dir=FIXTURES)
    assert [read_choice_reference(p.answer).letter for p in problems] == ["C", "D", "A", "D", "B", "C", "B"]
    assert read_choice_reference(problems[0].answer).options == ("10", "11", "12", "13")
    assert [p.source for p in problems[2:4]] == ["mmlu/elementary_mathematics", "mmlu/high_school_geography"]
    assert problems[0].id == "mmlu-test-0"
    assert problems[0].question == (
        "What is 7 + 5?\n\nA. 10\nB. 11\nC. 12\nD. 13\n\nAnswer with the letter of the correct choice (A, B, C or D)."
    )


def test_a_subject_selects_its_rows_and_limit_counts_within_it():
    assert [p.id for p in load_problems("mmlu/astronomy", data_dir=FIXTURES)] == ["mmlu-test-5", "mmlu-test-6"]
    assert [p.id for p in load_problems("mmlu/astronomy", data_dir=FIXTURES, limit=1)] == ["mmlu-test-5"]
    assert len(SUBJECTS) == len(set(SUBJECTS)) == 57


def test_unknown_subject_lists_the_closest_names():
    with pytest.raises(
        ValueError,
        match=r"^source=.mmlu/astronmy.: MMLU has no subject .astronmy.; closest: astronomy, anatomy \(use mmlu",
    ):
        load_problems("mmlu/astronmy", data_dir=FIXTURES)
    with pytest.raises(ValueError, match=r"^data.source='mmlu/geography': .*closest: high_school_geography"):
        check_source("mmlu/geography", data_dir=FIXTURES, prefix="data.")
    check_source("mmlu/astronomy", data_dir=FIXTURES)  # a real subject with its file: fine
    with pytest.raises(
        ValueError, match=r"does not exist; .* and set GTPO_DATA_DIR=DIR, or give data.path=FILE.jsonl$"
    ):
        check_source("mmlu", data_dir="/nonexistent", prefix="data.")
    with pytest.raises(ValueError, match="holds no question of the MMLU subject 'virology'"):
        load_problems("mmlu/virology", data_dir=FIXTURES)  # a real subject the file does not hold


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"answer": 4}, r":1: answer=4 must be a choice index 0..3 or a letter of \['A', 'B', 'C', 'D'\]"),
        ({"answer": True}, r":1: answer=True must be a choice index"),
        ({"choices": "A B C D"}, r":1: choices must be a list of 2..10 strings"),
        ({"choices": ["x", 3]}, r":1: every choice must be a string"),
        ({"subject": "cooking"}, r":1: subject='cooking' is not one of MMLU's subjects"),
        ({"question": " "}, r":1: question must be a non-empty string"),
    ],
)
def test_bad_rows_name_the_line_and_field(tmp_path, change, message):
    row = {"question": "Q?", "choices": ["a", "b", "c", "d"], "answer": 0, "subject": "anatomy"} | change
    (tmp_path / "mmlu").mkdir()
    (tmp_path / "mmlu" / "test.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=message):
        load_problems("mmlu", data_dir=str(tmp_path))


def test_letter_answers_and_missing_fields(tmp_path):
    (tmp_path / "mmlu").mkdir()
    rows = [{"question": "Q?", "choices": ["a", "b"], "answer": " b ", "subject": "anatomy"}, {"question": "Q?"}]
    (tmp_path / "mmlu" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=r"test.jsonl:2: MMLU rows need .*; missing \['choices', 'answer', 'subj"):
        load_problems("mmlu", data_dir=str(tmp_path))
    assert load_problems("mmlu", data_dir=str(tmp_path), limit=1)[0].answer == '{"letter": "B", "options": ["a", "b"]}'
