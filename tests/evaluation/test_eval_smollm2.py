"""SmolLM2-135M-Instruct on the real vLLM engine (CPU, in-process), one engine shared by two tests:
generation with log-probs against transformers, and the evaluator on 5 GSM8K test problems (reproducible)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from gtpo_megatron.builtin_models import resolve_model_path
from gtpo_megatron.data.datasets import default_data_dir
from gtpo_megatron.evaluation.cli import build_parser, config_from_args
from gtpo_megatron.evaluation.evaluate import run_evaluation
from gtpo_megatron.rollout.engine import SamplingConfig
from gtpo_megatron.rollout.engine_settings import EngineSettings
from gtpo_megatron.rollout.vllm_engine import VLLMEngine
from tests.helpers.data import needs_benchmark_data
from tests.integration.test_vllm_engine import check_structure, max_abs_diff

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # builds SmolLM2 (~85 s) and starts its engine
MODEL = "builtin:smollm2-135m-instruct"
SMOL_ATOL = 2e-3  # fp32 both sides; 30 layers of differently ordered CPU reductions (measured max ~1e-4)


@pytest.fixture(scope="module")
def engine():
    with VLLMEngine(
        MODEL, EngineSettings(dtype="float32", max_model_len=512, in_process=True, max_num_seqs=20)
    ) as engine:
        yield engine


def test_generate_chat_prompts_matches_hf(engine):
    path = resolve_model_path(MODEL)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, return_dict=True
            )["input_ids"]
        )
        for q in ("What is 12+7?", "Name a prime number.")
    ]
    outputs = engine.generate(prompts, 4, SamplingConfig(temperature=1.0, max_tokens=12, seed=0))
    check_structure(outputs, prompts, 4, 12, tokenizer.eos_token_id)
    assert any(c.text.strip() for o in outputs for c in o.completions)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert max_abs_diff(model, prompts, outputs, temperature=1.0) < SMOL_ATOL


@needs_benchmark_data("gsm8k/test.jsonl")
def test_gsm8k_five_problems_is_reproducible(engine, tmp_path):
    data_dir = default_data_dir()
    argv = [
        "--model",
        MODEL,
        "--benchmarks",
        "gsm8k",
        "--data-dir",
        str(data_dir),
        "--limit",
        "5",
        "--n",
        "4",
        "--k",
        "1,4",
        "--max-tokens",
        "32",
        "--reward-workers",
        "1",
        "--in-process",
    ]
    for out in ("a", "b"):  # same seed twice
        run_evaluation(
            config_from_args(build_parser().parse_args([*argv, "--output", str(tmp_path / out)])), engine=engine
        )

    results = json.loads((tmp_path / "a" / "results.json").read_text())["results"]["gsm8k"]
    for key in ("pass@1", "pass@4", "maj@4", "maj@1", "format_rate", "accuracy"):
        assert 0.0 <= results[key] <= 1.0, key
    assert results["pass@1"] <= results["pass@4"]
    assert results["num_problems"] == 5 and results["num_samples"] == 4
    assert 1 <= results["mean_length"] <= 32
    records = [json.loads(x) for x in (tmp_path / "a" / "records" / "gsm8k.jsonl").read_text().splitlines()]
    assert len(records) == 5 and all(len(r["completions"]) == 4 for r in records)
    assert records[0]["reference"] == "18"  # Janet's ducks
    assert json.loads((tmp_path / "b" / "results.json").read_text())["results"]["gsm8k"] == results
    again = [json.loads(x) for x in (tmp_path / "b" / "records" / "gsm8k.jsonl").read_text().splitlines()]
    assert [r["completions"] for r in again] == [r["completions"] for r in records]
