"""``gtpo-train`` argument handling: config errors exit 2 with the loader's message and no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from gtpo_megatron.train import main, parse_args

DEMO = str(Path(__file__).resolve().parents[2] / "configs" / "cpu_demo.yaml")


def test_parse_args_splits_config_and_overrides():
    args = parse_args(["--config", DEMO, "trainer.max_steps=3", "algorithm=grpo"])
    assert args.config == DEMO and args.overrides == ["trainer.max_steps=3", "algorithm=grpo"]


@pytest.mark.parametrize("override, fragment", [
    ("trainer.max_step=3", "did you mean 'trainer.max_steps'"),
    ("parallel.pp_size=2", "tp_size*pp_size must divide the world size"),
])
def test_config_errors_exit_2(override, fragment, monkeypatch, capsys):
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    assert main(["--config", DEMO, override]) == 2
    assert fragment in capsys.readouterr().err
