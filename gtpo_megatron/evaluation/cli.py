r"""``gtpo-eval``: pass@k / maj@k of a model on math benchmarks and MMLU with vLLM.

Example (the acceptance contract)::

    gtpo-eval --model builtin:smollm2-135m-instruct --benchmarks gsm8k --data-dir data \
        --limit 5 --n 4 --k 1,4 --output OUT

writes ``OUT/results.json`` (``results[benchmark]["pass@1"]``, ``["pass@4"]``, ``["maj@4"]``, fractions in [0, 1]),
``OUT/results.md`` and ``OUT/records/<benchmark>.jsonl`` (see ``evaluation/evaluate.py``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import get_args

from gtpo_megatron.config.rollout import EngineDtype
from gtpo_megatron.data.datasets import check_source, load_problems
from gtpo_megatron.data.prompts import SYSTEM_PROMPTS
from gtpo_megatron.evaluation.checkpoint_export import LORA_FORMATS
from gtpo_megatron.evaluation.evaluate import BENCHMARKS, EvalConfig, run_evaluation
from gtpo_megatron.logging import quiet_known_warnings, setup_logging
from gtpo_megatron.rewards.answer_text import EXTRACTION_MODES


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers, e.g. 1,8,16") from None


def _name_list(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def build_parser() -> argparse.ArgumentParser:
    """The ``gtpo-eval`` argument parser."""
    p = argparse.ArgumentParser(prog="gtpo-eval", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        required=True,
        help="HF model folder, hub name, builtin:NAME, or a gtpo-train run dir / its checkpoints/ folder "
        "/ a checkpoints/step_NNNNNN folder (exported once to <step dir>/hf and reused)",
    )
    p.add_argument(
        "--benchmarks",
        type=_name_list,
        default=BENCHMARKS,
        help=f"comma-separated: {','.join(BENCHMARKS)}, mmlu (every subject) or mmlu/SUBJECT (one), or Hugging "
        "Face dataset names",
    )
    p.add_argument(
        "--data-dir",
        default=None,
        help="folder holding gsm8k/, math500/, aime24/, aime25/, amc2023/, mmlu/ (`gtpo-data --out DIR` writes it; "
        "default: $GTPO_DATA_DIR, else ~/.cache/gtpo_megatron/data)",
    )
    p.add_argument("--limit", type=int, default=None, help="first N problems of each benchmark")
    p.add_argument("--n", type=int, default=64, help="completions sampled per problem")
    p.add_argument("--k", type=_int_list, default=(1, 8, 16, 32, 64), help="comma-separated k values (<= n)")
    p.add_argument("--temperature", type=float, default=0.9)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=1500, help="maximum completion length in tokens")
    p.add_argument("--seed", type=int, default=0, help="sampling seed; the same seed gives the same numbers")
    p.add_argument("--output", required=True, help="output folder (created)")
    p.add_argument("--reward", default="math_verify", help="registered reward whose `correct` verdict is scored")
    p.add_argument(
        "--extraction",
        choices=EXTRACTION_MODES,
        default=None,
        help="answer extraction for every benchmark: strict needs \\boxed{}, <answer> or a 'final answer' "
        "statement, lenient also takes the last number (default: lenient for gsm8k, strict for the "
        "others)",
    )
    p.add_argument("--reward-workers", type=int, default=2)
    p.add_argument("--reward-timeout", type=float, default=5.0, help="seconds per answer before it scores 0")
    p.add_argument(
        "--max-error-frac", type=float, default=0.5, help="stop when the grader fails on more of a benchmark's answers"
    )
    p.add_argument("--dtype", default="auto", choices=get_args(EngineDtype))
    p.add_argument(
        "--max-model-len", type=int, default=None, help="vLLM context length (default: longest prompt + max tokens)"
    )
    p.add_argument(
        "--in-process",
        action="store_true",
        help="run vLLM's engine core in this process (faster start; single-process use only)",
    )
    p.add_argument(
        "--lora-format",
        default="merged",
        choices=LORA_FORMATS,
        help="a LoRA run's checkpoint: serve its merged weights (<step dir>/hf) or the base model with its PEFT "
        "adapter folder (<step dir>/hf_adapter, a vLLM LoRA request)",
    )
    p.add_argument("--label", default=None, help="row label in results.md (default: the model name)")
    p.add_argument(
        "--system-prompt",
        default="concise",
        choices=tuple(SYSTEM_PROMPTS),
        help="system message of the prompts: the training run's data.system_prompt (default: concise)",
    )
    return p


def config_from_args(args: argparse.Namespace) -> EvalConfig:
    """Map parsed flags onto ``EvalConfig`` (which validates them)."""
    return EvalConfig(
        model=args.model,
        output_dir=args.output,
        benchmarks=args.benchmarks,
        data_dir=args.data_dir,
        limit=args.limit,
        n=args.n,
        ks=args.k,
        temperature=args.temperature,
        top_p=args.top_p,
        max_tokens=args.max_tokens,
        seed=args.seed,
        reward=args.reward,
        extraction=args.extraction,
        reward_workers=args.reward_workers,
        reward_timeout_s=args.reward_timeout,
        max_error_frac=args.max_error_frac,
        lora_format=args.lora_format,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        in_process=args.in_process,
        label=args.label,
        system_prompt=args.system_prompt,
    )


def setup_console() -> None:
    """gtpo-eval's console: this package's INFO lines, third-party loggers (Megatron's parameter lists) at WARNING."""
    import torch

    setup_logging(0)
    quiet_known_warnings(cuda=torch.cuda.is_available())  # before megatron-core is imported (a checkpoint's export)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``gtpo-eval``; prints the Markdown report. Returns the exit status."""
    setup_console()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
        for name in config.benchmarks:  # a typo or a broken file fails here, before the model and vLLM load
            check_source(name, split="test", data_dir=config.data_dir, data_dir_flag="--data-dir")
            load_problems(name, split="test", limit=config.limit, data_dir=config.data_dir)
    except (ValueError, FileNotFoundError) as err:
        parser.error(str(err))
    payload = run_evaluation(config)
    sys.stdout.write((Path(config.output_dir) / "results.md").read_text())
    sys.stdout.write(f"wrote {config.output_dir}/results.json in {payload['seconds']:.1f} s\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
