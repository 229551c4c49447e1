"""The evaluator's plumbing with a scripted engine (no vLLM): CLI parsing, scoring, files, report; gtpo-compare."""

from __future__ import annotations

import json

import pytest

from gtpo_megatron.evaluation.cli import build_parser, config_from_args
from gtpo_megatron.evaluation.compare import compare_runs, load_metrics
from gtpo_megatron.evaluation.evaluate import markdown_report, resolve_hf_model, run_evaluation
from gtpo_megatron.rollout.types import Completion, PromptCompletions
from gtpo_megatron.run_dir import mark_complete

SCRIPT = [  # completions per problem, in prompt order
    ["<reasoning>a</reasoning>\n<answer>5</answer>", "<answer>4</answer>", "the answer is 4", "no idea"],
    ["<answer>1,000</answer>", "<answer>100</answer>", "<answer>100.0</answer>", "<answer>1000</answer>"],
]


class ScriptedEngine:
    """Returns script[i] for prompt i; records the calls."""

    def __init__(self, script=SCRIPT) -> None:
        self.calls = []
        self.script = script

    def generate(self, prompt_ids, n, sampling):
        self.calls.append((len(prompt_ids), n, sampling))
        return [
            PromptCompletions(list(p), [Completion(list(range(len(t))), [0.0] * len(t), t, "stop") for t in texts])
            for p, texts in zip(prompt_ids, self.script)
        ]


@pytest.fixture
def data_dir(tmp_path):
    folder = tmp_path / "data" / "gsm8k"
    folder.mkdir(parents=True)
    rows = [
        {"question": "What is 2+3?", "answer": "2+3=5\n#### 5"},
        {"question": "What is 10*10?", "answer": "#### 100"},
    ]
    (folder / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(tmp_path / "data")


def test_contract_flags_parse():
    args = build_parser().parse_args(
        "--model M --benchmarks gsm8k --data-dir D --limit 5 --n 4 --k 1,4 --output OUT".split()
    )
    config = config_from_args(args)
    assert (config.model, config.benchmarks, config.data_dir, config.limit) == ("M", ("gsm8k",), "D", 5)
    assert (config.n, config.ks, config.output_dir) == (4, (1, 4), "OUT")
    assert config.sampling.seed == 0 and config.sampling.temperature == 0.9
    assert [config.extraction_for(b) for b in ("gsm8k", "math500", "aime24", "aime25", "amc23")] == [
        "lenient",
        "strict",
        "strict",
        "strict",
        "strict",
    ]
    strict = config_from_args(build_parser().parse_args("--model M --output O --extraction strict".split()))
    assert strict.extraction_for("gsm8k") == "strict"


def test_bad_extraction_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args("--model M --output O --extraction loose".split())
    assert "invalid choice: 'loose'" in capsys.readouterr().err


def test_k_larger_than_n_is_a_usage_error(capsys):
    from gtpo_megatron.evaluation.cli import main

    with pytest.raises(SystemExit):
        main("--model M --n 4 --k 1,8 --output OUT".split())
    assert "k values [1, 8]" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, fragment",
    [
        ("--model M --n 4 --k 1 --limit 0", "limit=0 must be >= 1"),
        ("--model /no/such/model --n 4 --k 1", "--model /no/such/model: no such folder"),
    ],
)
def test_bad_limit_and_missing_model_folder_are_usage_errors(flags, fragment, capsys):
    from gtpo_megatron.evaluation.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(f"{flags} --output OUT".split())
    assert exit_info.value.code == 2 and fragment in capsys.readouterr().err


@pytest.mark.parametrize(
    "benchmark, content, fragment",
    [
        ("gsm9k", None, "did you mean 'gsm8k'"),
        ("gsm8k", None, "test.jsonl does not exist"),
        ("gsm8k", '{"question": "1+1?", "answer": "#### 2"}\n{"question": "broken\n', "test.jsonl:2: malformed JSON"),
    ],
)
def test_benchmark_errors_are_usage_errors_before_the_model_loads(
    benchmark, content, fragment, tmp_path, capsys, monkeypatch
):
    from gtpo_megatron.evaluation import cli

    if content is not None:
        (tmp_path / "gsm8k").mkdir()
        (tmp_path / "gsm8k" / "test.jsonl").write_text(content)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "datasets" else object())
    monkeypatch.setattr(cli, "run_evaluation", lambda config: pytest.fail("must not load the model"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(f"--model M --benchmarks {benchmark} --data-dir {tmp_path} --n 2 --k 1 --output OUT".split())
    assert exit_info.value.code == 2
    assert fragment in capsys.readouterr().err


def test_model_folder_detection(tmp_path):
    megatron = tmp_path / "ckpt"
    megatron.mkdir()
    (megatron / "latest_checkpointed_iteration.txt").write_text("20")
    with pytest.raises(ValueError, match="Megatron checkpoint of another trainer"):
        resolve_hf_model(str(megatron))
    orphan = tmp_path / "orphan" / "step_000001"  # a gtpo-train step folder moved out of its run dir
    orphan.mkdir(parents=True)
    (orphan / "metadata.json").write_text("{}")
    with pytest.raises(ValueError, match="is not a complete checkpoint"):
        resolve_hf_model(str(orphan))
    mark_complete(orphan)
    with pytest.raises(FileNotFoundError, match="config.yaml"):
        resolve_hf_model(str(orphan))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="without config.json"):
        resolve_hf_model(str(tmp_path / "empty"))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert resolve_hf_model(str(tmp_path / "hf")) == str(tmp_path / "hf")


def _evaluate(tmp_path, data_dir, *flags, script=SCRIPT):
    args = build_parser().parse_args(
        [
            "--model",
            "builtin:tiny-llama",
            "--benchmarks",
            "gsm8k",
            "--data-dir",
            data_dir,
            "--n",
            "4",
            "--k",
            "1,4",
            "--output",
            str(tmp_path / "out"),
            "--reward-workers",
            "1",
            "--label",
            "tiny",
            *flags,
        ]
    )
    engine = ScriptedEngine(script)
    return run_evaluation(config_from_args(args), engine=engine), engine


def test_run_evaluation_scores_and_writes(tmp_path, data_dir):
    payload, engine = _evaluate(tmp_path, data_dir)
    assert engine.calls[0][:2] == (2, 4)
    r = payload["results"]["gsm8k"]
    # gsm8k is graded leniently. Problem 1 (gold 5): answers 5 (right), 4, 4, none -> c=1; the class {4, 4} wins.
    # Problem 2 (gold 100): classes {1,000, 1000} (wrong) and {100, 100.0} (right) tie 2-2 -> maj 1/2.
    assert r["pass@1"] == pytest.approx((1 / 4 + 2 / 4) / 2)
    assert r["pass@4"] == 1.0
    assert r["maj@1"] == 0.5 and r["maj@4"] == 0.25
    assert r["format_rate"] == 1 / 8 and r["num_problems"] == 2 and r["num_no_answer"] == 1  # "no idea"
    assert r["reward/num_timeouts"] == r["reward/num_errors"] == 0
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["results"] == payload["results"] and saved["extraction"] == {"gsm8k": "lenient"}
    records = [json.loads(x) for x in (tmp_path / "out" / "records" / "gsm8k.jsonl").read_text().splitlines()]
    assert [rec["num_correct"] for rec in records] == [1, 2]
    assert [rec["maj@4"] for rec in records] == [0.0, 0.5]
    assert [c["extracted"] for c in records[1]["completions"]] == ["1,000", "100", "100.0", "1000"]
    assert records[0]["completions"][0]["format_ok"] and records[0]["reference"] == "5"
    report = (tmp_path / "out" / "results.md").read_text()
    assert report.splitlines()[0] == "| model | GSM8K p@1 | GSM8K p@4 | GSM8K maj@4 |"
    assert report.splitlines()[2] == "| tiny | 37.5 | 100.0 | 25.0 |"
    assert report.splitlines()[6].endswith("| 0/0 | 1 |")


def test_extraction_flag_and_grader_failures_reach_the_results(tmp_path, data_dir):
    """--extraction strict on gsm8k: "the answer is 4" still has math-verify's "answer" anchor, "no idea" votes
    nothing; a power tower times out and is counted, not scored quietly."""
    script = [["\\boxed{5}", "\\boxed{9^{9^{9^{9}}}}", "4", "the answer is 4"], SCRIPT[1]]
    payload, _ = _evaluate(tmp_path, data_dir, "--extraction", "strict", "--reward-timeout", "1", script=script)
    r = payload["results"]["gsm8k"]
    assert payload["extraction"] == {"gsm8k": "strict"}
    assert (r["reward/num_timeouts"], r["reward/num_errors"]) == (1, 0)
    assert r["maj@4"] == pytest.approx((0.5 + 0.5) / 2)  # problem 1: 5 and 4 tie one vote each
    assert r["pass@1"] == pytest.approx((1 / 4 + 2 / 4) / 2)


def test_a_grader_that_fails_too_often_stops_the_evaluation(tmp_path):
    """References no grader can read: every answer is a grader error; no number is published."""
    folder = tmp_path / "data" / "gsm8k"
    folder.mkdir(parents=True)
    rows = [{"question": "q1", "answer": "#### see the figure"}, {"question": "q2", "answer": "#### ask the teacher"}]
    (folder / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    script = [["\\boxed{5}"] * 4, ["\\boxed{100}"] * 4]
    with pytest.raises(
        RuntimeError,
        match=r"^benchmark 'gsm8k': reward 'math_verify' failed to grade 8 of 8 answers \(0 timeouts, 8 errors\), "
        r"more than --max-error-frac=0.5; e.g. answer 0 \(error: ValueError: reference 'see the figure' holds no",
    ):
        _evaluate(tmp_path, str(tmp_path / "data"), script=script)
    assert not (tmp_path / "out" / "results.json").exists()
    payload, _ = _evaluate(tmp_path, str(tmp_path / "data"), "--max-error-frac", "1", script=script)
    r = payload["results"]["gsm8k"]
    assert (r["accuracy"], r["reward/num_timeouts"], r["reward/num_errors"]) == (0.0, 0.0, 8.0)
    with pytest.raises(ValueError, match=r"--max-error-frac=0.0 must be in \(0, 1\]"):
        config_from_args(build_parser().parse_args("--model M --output O --max-error-frac 0".split()))


def test_markdown_report_matches_table1_layout():
    res = {
        b: {
            "pass@64": 0.3,
            "maj@64": 0.425,
            "accuracy": 0.1,
            "format_rate": 1.0,
            "truncation_rate": 0.0,
            "mean_length": 100.0,
            "num_problems": 30.0,
            "num_samples": 64.0,
            "reward/num_timeouts": 2.0,
            "reward/num_errors": 0.0,
            "num_no_answer": 7.0,
        }
        for b in ("aime24", "amc23")
    }
    lines = markdown_report("Qwen GTPO", res, (64,)).splitlines()
    assert lines[0] == "| model | AIME24 p@64 | AIME24 maj@64 | AMC23 p@64 | AMC23 maj@64 |"
    assert lines[2] == "| Qwen GTPO | 30.0 | 42.5 | 30.0 | 42.5 |"
    assert lines[6] == "| AIME24 | 30 | 64 | 10.0 | 100.0 | 0.0 | 100.0 | 2/0 | 7 |"


def _write_run(folder, rows):
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_compare_runs(tmp_path):
    _write_run(
        tmp_path / "gtpo",
        [
            {
                "step": 1,
                "reward/mean": 0.0,
                "accuracy": 0.1,
                "entropy/completion_mean": 1.0,
                "format_rate": 0.25,
                "gtpo/filtered_frac": 0.5,
                "gtpo/conflict_frac": 0.2,
                "response/length_mean": 30.0,
            },
            {
                "step": 2,
                "reward/mean": 1.0,
                "accuracy": 0.3,
                "entropy/completion_mean": 0.5,
                "format_rate": 0.75,
                "gtpo/filtered_frac": 0.0,
                "gtpo/conflict_frac": 0.4,
                "response/length_mean": 20.0,
            },
        ],
    )
    _write_run(tmp_path / "grpo", [{"step": 1, "reward/mean": 2.0, "accuracy": 0.2, "entropy/completion_mean": 2.0}])
    png, md = compare_runs([str(tmp_path / "gtpo"), str(tmp_path / "grpo")], tmp_path / "cmp")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = md.read_text().splitlines()
    # accuracy, entropy/completion_mean, format_rate, filtered fraction, reward, conflicts, length: final | mean
    assert lines[0].startswith("| method | seeds | steps | accuracy final | accuracy mean | mean entropy (nats) final")
    assert (
        lines[2] == "| gtpo | 1 | 2 | 0.3 | 0.2 | 0.5 | 0.75 | 0.75 | 0.5 | 0 | 0.25 | 1 | 0.5 | 0.4 | 0.3 | 20 | 25 |"
    )
    assert lines[3] == "| grpo | 1 | 1 | 0.2 | 0.2 | 2 | 2 | - | - | - | - | 2 | 2 | - | - | - | - |"


def test_compare_errors_name_the_file_and_line(tmp_path):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "metrics.jsonl").write_text('{"step": 1}\n{"step": \n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2 is not valid JSON"):
        load_metrics(tmp_path / "bad")
    with pytest.raises(FileNotFoundError, match="metrics.jsonl does not exist"):
        load_metrics(tmp_path)


def test_compare_cli_on_a_folder_without_metrics_is_a_usage_error(tmp_path, capsys):
    from gtpo_megatron.evaluation.compare import main

    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path), "--output", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert "metrics.jsonl does not exist; pass run directories written by gtpo-train" in capsys.readouterr().err
