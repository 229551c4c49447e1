"""Write the paper-sized recipes ``configs/{model}_{data}_{algorithm}[_g12].yaml`` from one table.

Usage: ``python scripts/write_paper_recipes.py`` (rewrites the 24 files, :data:`EXTRA_RECIPES` and the paper's
LoRA setting ``..._lora.yaml``; the tests check that the committed files equal :func:`render_recipes`,
:func:`render_extra_recipes` and :func:`render_lora_recipes`). Each file stays a
complete recipe (every field, no includes); this script is the one owner of the values they share, so a change of,
say, the Adam betas is made once here.

Values: docs/algorithm.md section 6 where it speaks; where it is silent, the authors' code
(github.com/winstonsmith1897/GTPO, ``config.yaml`` and ``train_model.py``): AdamW betas, weight decay, cosine
schedule with warm-up, the 4000-token
prompt limit (keeps every GSM8K and MATH prompt), the seed. Each header says which is which.
"""

from __future__ import annotations

import math
import sys
import textwrap
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gtpo_megatron.config import config_to_dict, load_config  # noqa: E402

MODELS = {
    "qwen2.5-3b-instruct": dict(hf="Qwen/Qwen2.5-3B-Instruct", title="Qwen2.5-3B-Instruct", memory=0.35),
    "llama3.1-8b-instruct": dict(hf="meta-llama/Llama-3.1-8B-Instruct", title="Llama-3.1-8B-Instruct", memory=0.4),
}
DATA = {
    "gsm8k": dict(problems=7473, text="GSM8K train (7,473 problems, answer after ####)"),
    "math": dict(problems=7500, text="MATH train (7,500 problems, answer = last \\boxed{})"),
    "openr1-math": dict(
        problems=7500,
        text="OpenR1-Math-220k (DeepSeek-R1 math traces, config default; its problems and verified final answers, "
        "unverified rows dropped and counted: gtpo_megatron/data/openr1.py; 7,500 steps of one prompt, a part of one "
        "epoch; `gtpo-data openr1-math` writes the file)",
    ),
}
PAPER_DATA = ("gsm8k", "math")
EXTRA_RECIPES = (("qwen2.5-3b-instruct", "openr1-math", "gtpo", 8),)
"""Recipes beyond the paper's grid: (model, data, algorithm, group size)."""
ALGORITHMS = {
    "gtpo": "GTPO (docs/algorithm.md sections 1-4): conflict-aware token weights, entropy filter and penalty.",
    "grpo": "GRPO baseline (docs/algorithm.md section 5): std-normalised advantages, clip 0.2, KL to the initial "
    "policy with beta = 1e-6 (the paper's runs; k3 estimator).",
    "dapo": "DAPO baseline (docs/algorithm.md section 5): clip-higher 0.2/0.28, token-mean, dynamic sampling, overlong "
    "shaping (the penalty reaches one reward range: 20 on the 0-20 paper reward).",
}
GROUP_SIZES = (8, 12)
LORA = ("model.lora.rank=128", "model.lora.alpha=128", "model.lora.target_modules=[all-linear]")
"""The paper's adapters: rank 128, alpha 128 on q, k, v, o, gate, up and down (docs/algorithm.md section 6)."""
LORA_TEXT = (
    "LoRA: the paper's adapters, rank 128, alpha 128 on q, k, v, o, gate, up and down (model.lora; the base frozen "
    "in bf16, not 4-bit), the KL reference the base with the adapters off; the engines get the merged weights "
    "(rollout.lora_sync: merged; rollout.lora_sync=adapter sends only the adapters)."
)
WARMUP_RATIO = 0.005
AUTHORS = (
    "Where the spec is silent, the authors' code (github.com/winstonsmith1897/GTPO, config.yaml): AdamW betas "
    "(0.999999, 0.999999) (an earlier commit had (0.9, 0.95)), weight decay 0.1, cosine decay to 0 after a linear "
    "warm-up over 0.5% of the steps ({warmup}), a 4000-token prompt limit (keeps every GSM8K and MATH prompt), seed "
    "3407, their system prompt (data.system_prompt: authors). Not reproduced: LoRA rank 128 on a 4-bit model (full "
    "fine-tuning here) and paged 8-bit AdamW (Megatron's fp32 Adam); log-probs at the sampling temperature "
    "(algorithm.loss_temperature: 1.0 gives the authors' T=1)."
)


def _comment(*paragraphs: str) -> str:
    """``# ``-prefixed lines of at most 120 characters."""
    return "".join(textwrap.fill(p, width=118, initial_indent="# ", subsequent_indent="# ") + "\n" for p in paragraphs)


def _layout(model: str, group_size: int) -> tuple[int, bool]:
    """(tp_size, sequence_parallel) on 8 GPUs: dp = 8 / tp must divide the G sequences of a step."""
    tp = 2 if model.startswith("llama") or group_size % 8 else 1
    return tp, tp > 1


def _filter(model: str, algorithm: str) -> tuple[list[str], list[str]]:
    """The GTPO entropy filter of ``model``: (overrides, header paragraphs)."""
    if algorithm != "gtpo":
        return [], []
    if model.startswith("llama"):
        return ["algorithm.entropy_filter=fixed", "algorithm.entropy_threshold=0.7"], [
            "Entropy filter: a fixed 0.7-nat threshold, as the authors' code ran Llama-3.1-8B."
        ]
    return [], ["Entropy filter: the paper's ln 2 rule (the authors' code ran Qwen2.5-3B without a filter: off)."]


def recipe_overrides(model: str, data: str, algorithm: str, group_size: int, lora: bool = False) -> list[str]:
    """The dotted overrides of one recipe on top of the config defaults and the algorithm preset."""
    tp, sequence_parallel = _layout(model, group_size)
    steps = DATA[data]["problems"]
    overrides = [
        f"output_dir=runs/{recipe_stem(model, data, algorithm, group_size, lora)}",
        f"model.name_or_path={MODELS[model]['hf']}",
        "model.recompute=selective",
        f"parallel.tp_size={tp}",
        f"parallel.sequence_parallel={str(sequence_parallel).lower()}",
        "parallel.use_distributed_optimizer=true",
        "parallel.backend=nccl",
        "rollout.max_prompt_len=4000",
        "rollout.dtype=bfloat16",
        f"rollout.gpu_memory_utilization={MODELS[model]['memory']}",
        "rollout.cpu_kv_cache_gib=4.0",
        f"algorithm.name={algorithm}",
        f"algorithm.group_size={group_size}",
        "algorithm.logprob_chunk_size=4096",
        "optim.min_lr=0.0",
        f"optim.warmup_steps={math.ceil(WARMUP_RATIO * steps)}",
        "optim.weight_decay=0.1",
        "optim.adam_beta1=0.999999",
        "optim.adam_beta2=0.999999",
        "optim.max_tokens_per_micro_batch=5500",  # one full-length sequence; shorter ones share a micro-batch
        "optim.packing=true",
        f"data.source={data}",
        "data.shuffle_seed=3407",
        "data.system_prompt=authors",
        "reward.num_workers=4",
        f"trainer.max_steps={steps}",
        "trainer.seed=3407",
        "trainer.log_every=10",
        "checkpoint.every_n_steps=500",
    ]
    if algorithm == "grpo":
        overrides.append("algorithm.kl_coef=1e-6")
    return overrides + _filter(model, algorithm)[0] + (list(LORA) if lora else [])


def recipe_stem(model: str, data: str, algorithm: str, group_size: int, lora: bool = False) -> str:
    """File stem: ``{model}_{data}_{algorithm}`` for G=8, with ``_g12`` for G=12, ``_lora`` with the adapters."""
    return f"{model}_{data}_{algorithm}" + ("" if group_size == 8 else f"_g{group_size}") + ("_lora" if lora else "")


def _authors(warmup: int, lora: bool) -> str:
    """:data:`AUTHORS`; with ``lora`` the paper's adapters are reproduced (:data:`LORA_TEXT`)."""
    text = AUTHORS.format(warmup=warmup)
    if lora:
        text = text.replace("LoRA rank 128 on a 4-bit model (full fine-tuning here)", "the 4-bit base model")
    return text


def _header(model: str, data: str, algorithm: str, group_size: int, lora: bool = False) -> str:
    tp, _ = _layout(model, group_size)
    stem = recipe_stem(model, data, algorithm, group_size, lora)
    warmup = math.ceil(WARMUP_RATIO * DATA[data]["problems"])
    return (
        _comment(
            f"{MODELS[model]['title']} on {DATA[data]['text']}, {algorithm.upper()}, G={group_size}. Complete "
            "recipe (no includes), written by scripts/write_paper_recipes.py (edit the script, not this file).",
            ALGORITHMS[algorithm],
            "Paper setup (docs/algorithm.md section 6): one prompt per step, temperature 0.9, top_p 1, max 1500 "
            "completion tokens, lr 1e-6 AdamW, grad clip 0.1, one epoch, the paper reward (format 10 + correct 10).",
            _authors(warmup, lora),
            *_filter(model, algorithm)[1],
            *([LORA_TEXT] if lora else []),
            f"Layout: 8 GPUs of 80 GB, TP={tp} x DP={8 // tp}, vLLM colocated (sleeps while training). Launch:",
        )
        + f"#   torchrun --nproc_per_node=8 -m gtpo_megatron.train --config configs/{stem}.yaml\n"
    )


def render_recipe(model: str, data: str, algorithm: str, group_size: int, lora: bool = False) -> tuple[str, str]:
    """``(file name, text)`` of one recipe (``lora``: the paper's adapters)."""
    cfg = config_to_dict(load_config(None, recipe_overrides(model, data, algorithm, group_size, lora)))
    ordered = {"output_dir": cfg.pop("output_dir"), "resume": cfg.pop("resume"), **cfg}
    body = yaml.safe_dump(ordered, sort_keys=False)
    header = _header(model, data, algorithm, group_size, lora)
    return recipe_stem(model, data, algorithm, group_size, lora) + ".yaml", header + body


def render_recipes() -> dict[str, str]:
    """``{file name: text}`` of every paper recipe."""
    grid = [(m, d, a, g) for m in MODELS for d in PAPER_DATA for a in ALGORITHMS for g in GROUP_SIZES]
    return dict(render_recipe(*recipe) for recipe in grid)


def render_extra_recipes() -> dict[str, str]:
    """``{file name: text}`` of :data:`EXTRA_RECIPES`."""
    return dict(render_recipe(*recipe) for recipe in EXTRA_RECIPES)


def render_lora_recipes() -> dict[str, str]:
    """``{file name: text}`` of the paper's LoRA setting: every model, data set and algorithm at G=8."""
    grid = [(m, d, a, 8, True) for m in MODELS for d in PAPER_DATA for a in ALGORITHMS]
    return dict(render_recipe(*recipe) for recipe in grid)


def main() -> None:
    """Write every recipe into ``configs/``."""
    for name, text in (render_recipes() | render_extra_recipes() | render_lora_recipes()).items():
        (REPO / "configs" / name).write_text(text)
        print(f"wrote configs/{name}")


if __name__ == "__main__":
    main()
