"""OpenR1-Math-220k rows (the fixture holds the hub's fields) through the trainer's loader path: fields mapped,
unusable answers dropped and counted by reason."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from gtpo_megatron.data import load_problems
from gtpo_megatron.data.datasets import check_source

FIXTURES = Path(__file__).parent / "fixtures"
ROWS = FIXTURES / "openr1-math" / "train.jsonl"


def test_verified_rows_load_and_the_rest_are_dropped_and_counted(caplog):
    with caplog.at_level(logging.WARNING, logger="gtpo_megatron.data.datasets"):
        problems = load_problems("openr1-math", data_dir=str(FIXTURES))
    assert [(p.id, p.answer, p.source) for p in problems] == [
        ("r1-a", "4", "openr1-math"),  # verified by math-verify
        ("r1-b", "\\frac{5}{6}", "openr1-math"),  # verified by the Llama judge only
    ]
    assert problems[0].question == "Find $x$ if $2x + 3 = 11$."
    assert caplog.messages == [
        f"{ROWS}: dropped 4 rows (no_final_answer 2, unparseable_answer 1, unverified 1); kept 2 problems"
    ]


def test_the_trainer_config_path_loads_the_same_rows(tmp_path):
    """data.source=openr1-math with data.path=FILE (build.build_loader's call), and check_source's checks."""
    check_source("openr1-math", path=str(ROWS), prefix="data.")
    assert [p.id for p in load_problems("openr1-math", path=str(ROWS), split="train", limit=1)] == ["r1-a"]
    with pytest.raises(ValueError, match="data.source='openr1-math': .*openr1-math/train.jsonl does not exist"):
        check_source("openr1-math", split="train", data_dir=str(tmp_path), prefix="data.")


def test_a_row_without_the_verification_fields_is_an_error(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"problem": "1+1?", "answer": "2"}) + "\n")
    with pytest.raises(ValueError, match=r"rows.jsonl:1: openr1-math rows need .*missing \['correctness_math_verify'"):
        load_problems("openr1-math", path=str(path))
    path.write_text(json.dumps({"problem": "1+1?", "answer": "2", "correctness_math_verify": "yes"}) + "\n")
    with pytest.raises(ValueError, match="correctness_math_verify must be a list of booleans or null, got 'yes'"):
        load_problems("openr1-math", path=str(path))


def test_the_r1_recipe_is_its_generator_output_and_validates():
    import importlib.util

    from gtpo_megatron.config import load_config
    from gtpo_megatron.megatron_adapter.validation import validate_config

    repo = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("write_paper_recipes", repo / "scripts/write_paper_recipes.py")
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    ((name, text),) = generator.render_extra_recipes().items()
    assert name == "qwen2.5-3b-instruct_openr1-math_gtpo.yaml" and (repo / "configs" / name).read_text() == text
    cfg = load_config(repo / "configs" / name)
    validate_config(cfg, 8, check_registries=False)
    assert (cfg.data.source, cfg.data.split, cfg.algorithm.name, cfg.reward.name) == ("openr1-math", "train", "gtpo",
                                                                                      "paper")  # fmt: skip
