"""MMLU in the evaluator with a scripted engine: hand-written letter answers graded by the choice reward, exact
accuracy / pass@k / maj@k per subject and pooled, answers that state no single letter counted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gtpo_megatron.evaluation.cli import build_parser, config_from_args
from gtpo_megatron.evaluation.evaluate import run_evaluation
from gtpo_megatron.evaluation.metrics import pool_summaries
from gtpo_megatron.rollout.types import Completion, PromptCompletions

FIXTURES = str(Path(__file__).parents[1] / "data" / "fixtures")
SCRIPTS = [  # one engine call per subject, in file order; two completions per question
    [  # elementary_mathematics, gold C, D, A
        ["<answer>C</answer>", "<answer>(C)</answer>"],
        ["<answer>\\text{D}</answer>", "The answer is (D)."],
        ["<answer>\\textbf{(B)}</answer>", "\\boxed{A}"],
    ],
    [  # high_school_geography, gold D, B
        ["<reasoning>the Pacific</reasoning>\n<answer>D</answer>", "<answer>Pacific</answer>"],
        ["The final answer is B", "<answer>C) Paris</answer>"],  # Paris is B, but the stated letter wins
    ],
    [  # astronomy, gold C, B
        ["<answer>A</answer>", "<answer>A or C</answer>"],  # two letters: no answer
        ["<answer>B</answer>", "<answer>**B.**</answer>"],
    ],
]


class SubjectEngine:
    """Returns ``scripts[i]`` on its i-th call; records the prompt counts."""

    def __init__(self, scripts=SCRIPTS) -> None:
        self.calls = []
        self.scripts = scripts

    def generate(self, prompt_ids, n, sampling):
        script = self.scripts[len(self.calls)]
        self.calls.append(len(prompt_ids))
        return [
            PromptCompletions(list(p), [Completion([0] * len(t), [0.0] * len(t), t, "stop") for t in texts])
            for p, texts in zip(prompt_ids, script, strict=True)
        ]


def _flags(tmp_path, benchmarks="mmlu"):
    return ["--model", "builtin:tiny-llama", "--benchmarks", benchmarks, "--data-dir", FIXTURES, "--n", "2",
            "--k", "1,2", "--output", str(tmp_path / "out"), "--reward-workers", "1"]  # fmt: skip


def test_letters_are_scored_per_subject_and_pooled(tmp_path):
    engine = SubjectEngine()
    payload = run_evaluation(config_from_args(build_parser().parse_args(_flags(tmp_path))), engine=engine)
    assert engine.calls == [3, 2, 2]
    r = payload["results"]
    assert list(r) == ["mmlu/elementary_mathematics", "mmlu/high_school_geography", "mmlu/astronomy", "mmlu"]
    keys = ("accuracy", "pass@1", "pass@2", "maj@1", "maj@2", "num_no_answer", "num_problems")
    got = {b: tuple(round(r[b][k], 6) for k in keys) for b in r}
    assert got == {
        # C and (C) are one class; \textbf{(B)} (wrong) and \boxed{A} (right) tie: maj@2 0.5
        "mmlu/elementary_mathematics": (
            round(5 / 6, 6),
            round(2.5 / 3, 6),
            1.0,
            round(2 / 3, 6),  # maj@1: the first sample of each question
            round(2.5 / 3, 6),
            0,
            3,
        ),
        "mmlu/high_school_geography": (0.75, 0.75, 1.0, 1.0, 0.75, 0, 2),  # Pacific: option D's text
        "mmlu/astronomy": (0.5, 0.5, 0.5, 0.5, 0.5, 1, 2),
        "mmlu": (round(10 / 14, 6), round(5 / 7, 6), round(6 / 7, 6), round(5 / 7, 6), round(5 / 7, 6), 1, 7),
    }
    assert payload["extraction"]["mmlu/astronomy"] == "strict"
    records = [json.loads(x) for x in (tmp_path / "out/records/mmlu/astronomy.jsonl").read_text().splitlines()]
    assert [c["extracted"] for c in records[1]["completions"]] == ["B", "B"]
    assert json.loads(records[0]["reference"]) == {"letter": "C", "options": ["Venus", "Earth", "Mercury", "Mars"]}
    report = (tmp_path / "out" / "results.md").read_text().splitlines()
    assert report[0] == "| model | MMLU p@1 | MMLU p@2 | MMLU maj@2 |"
    assert "| mmlu/astronomy | 2 | 50.0 | 50.0 | 50.0 | 50.0 |" in report
    assert report[-5] == "| subject | problems | accuracy | pass@1 | pass@2 | maj@2 |"


def test_one_subject_is_selected_by_name(tmp_path):
    config = config_from_args(build_parser().parse_args(_flags(tmp_path, "mmlu/astronomy")))
    payload = run_evaluation(config, engine=SubjectEngine(SCRIPTS[2:]))
    assert list(payload["results"]) == ["mmlu/astronomy", "mmlu"]
    assert payload["results"]["mmlu"]["accuracy"] == payload["results"]["mmlu/astronomy"]["accuracy"] == 0.5


def test_unknown_subject_is_a_usage_error_before_the_model_loads(tmp_path, capsys):
    from gtpo_megatron.evaluation.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(_flags(tmp_path, "mmlu/astronmy"))
    assert exit_info.value.code == 2
    assert "MMLU has no subject 'astronmy'; closest: astronomy, anatomy" in capsys.readouterr().err


def test_missing_mmlu_file_names_the_option_gtpo_eval_accepts(tmp_path, capsys):
    from gtpo_megatron.evaluation.cli import main

    flags = _flags(tmp_path)
    flags[flags.index("--data-dir") + 1] = str(tmp_path / "empty")
    with pytest.raises(SystemExit) as exit_info:
        main(flags)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert "mmlu/test.jsonl does not exist; download the benchmarks once with `gtpo-data --out DIR mmlu`" in err
    assert err.rstrip().endswith("and pass --data-dir DIR or set GTPO_DATA_DIR=DIR")
    assert "path=" not in err  # gtpo-eval has no file option


def test_pooling_weights_by_problems_and_adds_counts():
    a = {"accuracy": 1.0, "pass@1": 1.0, "num_problems": 1.0, "num_samples": 4.0, "num_no_answer": 0.0,
         "reward/num_errors": 1.0}  # fmt: skip
    b = {"accuracy": 0.25, "pass@1": 0.5, "num_problems": 3.0, "num_samples": 4.0, "num_no_answer": 5.0,
         "reward/num_errors": 2.0}  # fmt: skip
    assert pool_summaries([a, b]) == {"accuracy": 0.4375, "pass@1": 0.625, "num_problems": 4.0, "num_samples": 4.0,
                                      "num_no_answer": 5.0, "reward/num_errors": 3.0}  # fmt: skip
    with pytest.raises(ValueError, match=r"one num_samples per problem; got \[2.0, 4.0\]"):
        pool_summaries([a, {**b, "num_samples": 2.0}])
