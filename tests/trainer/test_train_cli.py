"""``gtpo-train`` argument handling: config errors exit 2 with the loader's message and no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gtpo_megatron.train import main, parse_args

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "configs" / "cpu_demo.yaml")


def test_parse_args_splits_config_and_overrides():
    args = parse_args(["--config", DEMO, "trainer.max_steps=3", "algorithm=grpo"])
    assert args.config == DEMO and args.overrides == ["trainer.max_steps=3", "algorithm=grpo"]


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("trainer.max_step=3", "did you mean 'trainer.max_steps'"),
        ("parallel.pp_size=2", "tp_size*pp_size must divide the world size"),
    ],
)
def test_config_errors_exit_2(override, fragment, monkeypatch, capsys):
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    assert main(["--config", DEMO, override]) == 2
    assert fragment in capsys.readouterr().err


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("data.path=/no/such/file.jsonl", "data.path='/no/such/file.jsonl': no such file"),
        ("data=math500", "data.split='train': 'math500' has only the split(s) ['test']; use data.split=test"),
        ("model=builtin:nope", "model.name_or_path='builtin:nope' is not a built-in model"),
        ("model=/no/such/model", "model.name_or_path='/no/such/model': no such folder"),
    ],
)
def test_missing_model_or_data_fails_before_model_loading(override, fragment, monkeypatch, capsys):
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    assert main(["--config", DEMO, override, "output_dir=/tmp/gtpo-unused"]) == 2
    assert fragment in capsys.readouterr().err


def test_unknown_data_source_fails_before_model_loading(monkeypatch, capsys):
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "GTPO_DATA_DIR": "/no/such/dir"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "datasets" else object())
    assert main(["--config", DEMO, "data=gsm8", "output_dir=/tmp/gtpo-unused"]) == 2
    err = capsys.readouterr().err
    assert "data.source='gsm8'" in err and "did you mean 'gsm8k'" in err
    assert main(["--config", DEMO, "data=gsm8k", "output_dir=/tmp/gtpo-unused"]) == 2
    assert "/no/such/dir/gsm8k/train.jsonl does not exist" in capsys.readouterr().err


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("model.megatron_overrides={sequence_parallel: true}", "sequence_parallel (set by parallel.sequence_parallel)"),
        ("model.params_dtype=float16", "model.params_dtype='float16': must be one of ['float32', 'bfloat16']"),
    ],
)
def test_policy_settings_errors_exit_2_before_any_process_group(override, fragment, monkeypatch, capsys):
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    assert main(["--config", DEMO, override, "output_dir=/tmp/gtpo-unused"]) == 2
    assert fragment in capsys.readouterr().err


def _entry_point(launcher: list[str], *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    command = [*launcher, "-m", "gtpo_megatron.train", "--config", DEMO, *args, "output_dir=/tmp/gtpo-unused"]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)


def test_config_error_alone_is_one_line_exit_2_no_traceback():
    run = _entry_point([sys.executable], "trainer.max_steps=0")
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines() == [
        "gtpo-train: config error: trainer.max_steps=0: must be >= 1; use e.g. 20"
    ]


def test_gtpo_train_alone_names_the_torchrun_line_for_a_layout_of_several_ranks():
    run = _entry_point([sys.executable], "trainer.max_steps=3")
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "gtpo-train: config error: parallel.tp_size/pp_size/ep_size=2/1/1 needs 2 ranks and gtpo-train alone is one "
        f"process; run torchrun --nproc_per_node=2 -m gtpo_megatron.train --config {DEMO} trainer.max_steps=3 "
        "output_dir=/tmp/gtpo-unused"
    ]


@pytest.mark.slow
def test_config_error_under_torchrun_is_said_once_as_the_root_cause():
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master-port=0"]
    run = _entry_point(torchrun, "trainer.max_steps=0")
    output = run.stdout + run.stderr
    assert run.returncode != 0 and output.count("trainer.max_steps=0: must be >= 1") == 1
    root_cause = output.split("Root Cause (first observed failure):")[1]
    assert "exitcode  : 2" in root_cause
    assert "traceback : gtpo-train: config error: trainer.max_steps=0: must be >= 1; use e.g. 20" in root_cause
