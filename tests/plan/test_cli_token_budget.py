"""gtpo-plan under ``optim.max_tokens_per_micro_batch``: activations from the budget, long-response settings."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from gtpo_megatron.plan.architectures import resolve_architecture
from gtpo_megatron.plan.memory import TrainingShape, activation_bytes
from gtpo_megatron.plan_cli import run

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
QWEN_8GPU = str(CONFIGS / "qwen2.5-32b_gsm8k_gtpo_8gpu.yaml")
GIB = 2**30


def _activations_line(text: str) -> tuple[int, float, float]:
    match = re.search(r"activations from (\d+) tokens a micro-batch, stage 0: model.recompute=none ([\d.]+) GiB, "
                      r"model.recompute=full ([\d.]+) GiB", text)  # fmt: skip
    assert match, text
    return int(match.group(1)), float(match.group(2)), float(match.group(3))


def test_budget_replaces_rows_times_length_in_every_activation_term():
    arch = resolve_architecture("Qwen/Qwen2.5-32B-Instruct")
    rows = TrainingShape(tp_size=8, pp_size=2, dp_size=1, micro_batch_size=2, seq_length=5500, num_microbatches=8)
    budget = dataclasses.replace(rows, micro_batch_size=1, max_tokens_per_micro_batch=11000)
    for recompute in ("none", "full"):
        a, b = (dataclasses.replace(s, recompute=recompute) for s in (rows, budget))
        assert activation_bytes(arch, a, stage=0) == activation_bytes(arch, b, stage=0) > 0
    assert budget.micro_batch_tokens == rows.micro_batch_tokens == 11000


@pytest.mark.parametrize(
    ("max_tokens", "fits"), [(1500, True), (8000, True), (32000, False)], ids=["paper-1.5k", "8k", "32k"]
)
def test_long_responses_print_activations_with_and_without_recompute(max_tokens: int, fits: bool):
    budget = 4000 + max_tokens  # the recipe's prompt limit plus the response
    status, text = run(["--config", QWEN_8GPU, "--gpus", "8", f"rollout.max_tokens={max_tokens}",
                        f"optim.max_tokens_per_micro_batch={budget}"])  # fmt: skip
    tokens, none_gib, full_gib = _activations_line(text)
    assert tokens == budget and none_gib > 10 * full_gib  # 64 layers kept vs one layer plus the layer inputs
    assert f"of <= {budget} tokens (optim.max_tokens_per_micro_batch, packed)" in text
    assert (status == 0) is fits, text
    if not fits:
        assert "training phase needs" in text and "more GPUs or a larger parallel.tp_size*parallel.pp_size" in text


def test_budget_plan_matches_the_equivalent_rows_plan():
    rows = ["--config", QWEN_8GPU, "--gpus", "8", "optim.max_tokens_per_micro_batch=null", "optim.packing=false"]
    _, by_rows = run(rows)
    _, by_budget = run(["--config", QWEN_8GPU, "--gpus", "8"])  # the recipe: 5500 tokens = one 5500-token row
    assert _activations_line(by_rows) == _activations_line(by_budget)
    table = [line for line in by_budget.splitlines() if line.startswith(("activations ", "logits/entropy"))]
    assert table == [line for line in by_rows.splitlines() if line.startswith(("activations ", "logits/entropy"))]
    assert "at most 128 micro-batches (every sequence 5500 tokens) of <= 5500 tokens" in by_budget
