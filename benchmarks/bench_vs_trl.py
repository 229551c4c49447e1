"""The CPU demo's workload through ``gtpo-train`` and through TRL's GRPOTrainer, interleaved in one run (not a test).

Usage: ``python benchmarks/bench_vs_trl.py [--steps 3] [--rounds 1] [--layout single|demo] [--trl-path DIR]``

Workload of both (the demo's, ``configs/cpu_demo.yaml``): the built-in SmolLM2-135M-Instruct (a local folder, never
a hub download) in fp32, the built-in arithmetic prompts with the same system prompt and chat template, 2 prompts x 8
completions a step, 64 new tokens, temperature 0.7, lr 2e-5, no KL term, one update per batch. Each round runs the
product (``--layout single``: one process, TP 1; ``demo``: the README's two gloo ranks, TP 2) and then TRL, each in a
fresh process; ``--steps 8`` is the issue's original length. Step 1 of each run is warm-up (and the product's step 1
also measures the initial entropy, docs/algorithm.md section 4), so the means are over steps 2..N.

Prints per run and over all runs: seconds per step, rollout (generation + rewards), train (forward, backward,
optimizer: the product's ``time/train_s``; TRL's step minus its generation), the tokens trained (prompt + response,
no padding) and the ratios product / TRL of step, rollout, train and train seconds per token. TRL is not a dependency:
where ``import trl`` fails (after prepending ``--trl-path`` or ``$GTPO_TRL_PATH`` to the child's ``PYTHONPATH``), the
TRL runs are skipped and said so. TRL generates with transformers (no vLLM on the CPU in TRL); it is run with
``per_device_train_batch_size=16`` (one forward of the 16 rows), its default layout for this batch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = "builtin:smollm2-135m-instruct"
PROMPTS, GROUP, MAX_TOKENS, TEMPERATURE, LR = 2, 8, 64, 0.7, 2e-5


def _env(extra_path: str | None) -> dict[str, str]:
    """The children's environment: this checkout first on ``PYTHONPATH`` (and ``extra_path`` before it)."""
    paths = [p for p in (extra_path, str(ROOT), os.environ.get("PYTHONPATH")) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "WANDB_MODE": "disabled"}


def _run_logged(command: list[str], env: dict[str, str], log_path: Path) -> None:
    """Run ``command`` with its output in ``log_path``; on failure print the log's tail and exit."""
    with open(log_path, "w") as log:
        code = subprocess.run(command, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
    if code != 0:
        sys.exit(
            f"{command[:4]} failed ({code}); the end of {log_path}:\n"
            + "".join(log_path.read_text().splitlines(True)[-30:])
        )


def product_run(args, out: Path) -> list[dict]:
    """One ``gtpo-train`` run of ``args.steps`` steps; per step: seconds of step, rollout, train and tokens."""
    overrides = [
        f"output_dir={out}",
        f"trainer.max_steps={args.steps}",
        "logging.progress=false",
        "logging.wandb_mode=disabled",
        f"checkpoint.every_n_steps={args.steps + 1}",
        *args.override,
    ]
    if args.layout == "single":
        command = [
            sys.executable,
            "-m",
            "gtpo_megatron.train",
            "--config",
            str(ROOT / "configs/cpu_demo.yaml"),
            "parallel.tp_size=1",
            "model.pad_attention_heads=false",
            *overrides,
        ]
    else:
        torchrun = str(Path(sys.executable).with_name("torchrun"))
        command = [
            torchrun,
            "--nproc_per_node=2",
            "--master-port=29731",
            "-m",
            "gtpo_megatron.train",
            "--config",
            str(ROOT / "configs/cpu_demo.yaml"),
            *overrides,
        ]
    _run_logged(command, _env(None), out.with_suffix(".log"))
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [
        {
            "step_s": m["time/step_s"],
            "rollout_s": m["time/rollout_s"],
            "train_s": m["time/train_s"],
            "tokens": m["perf/tokens_per_s"] * m["time/step_s"],
            "response_tokens": m["perf/response_tokens_per_s"] * m["time/step_s"],
        }
        for m in steps
    ]


def trl_run(args, out: Path) -> list[dict] | None:
    """One TRL run in a fresh process (``--child``); None where ``trl`` is not importable there."""
    env = _env(args.trl_path)
    probe = subprocess.run([sys.executable, "-c", "import trl"], env=env, capture_output=True, text=True)
    if probe.returncode != 0:
        print(
            f"TRL skipped: `import trl` fails ({probe.stderr.strip().splitlines()[-1]}); install it into a folder "
            "and pass --trl-path (e.g. pip install --target DIR trl==1.16.0 datasets pandas pyarrow)"
        )
        return None
    command = [sys.executable, __file__, "--child", str(out), "--steps", str(args.steps)]
    _run_logged(command, env, out.with_suffix(".log"))
    return json.loads((out / "steps.json").read_text())


def _trl_dataset(num_rows: int):
    """The demo's prompts as chat messages, with their reference answers."""
    import pyarrow
    from datasets import Dataset

    from gtpo_megatron.data.prompts import build_messages
    from gtpo_megatron.data.synthetic import generate_problems

    problems = generate_problems(num_rows, seed=0, split="train", difficulty="easy")
    rows = [{"prompt": build_messages(p.question), "answer": p.answer} for p in problems]
    # A fixed fingerprint: hashing the table fails with some dill/pyarrow pairs, and nothing here is cached.
    return Dataset(pyarrow.Table.from_pylist(rows), fingerprint=f"gtpo_demo_prompts_{num_rows}")


def _trl_reward(completions, answer, **_):
    """The demo's reward (``math_verify``) on TRL's conversational completions."""
    from gtpo_megatron.rewards.registry import get_reward

    score = get_reward("math_verify")
    return [float(score(completion=c[0]["content"], reference=a).score) for c, a in zip(completions, answer)]


def trl_child(out: Path, steps: int) -> None:
    """TRL's GRPOTrainer for ``steps`` steps; writes ``out/steps.json`` (the records of ``product_run``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from gtpo_megatron.builtin_models import resolve_model_path

    records, generation = [], {}

    class Timer(TrainerCallback):
        def on_step_begin(self, *_, **__):
            generation.clear()
            generation["start"] = time.perf_counter()

        def on_step_end(self, *_, **__):
            step_s = time.perf_counter() - generation["start"]
            records.append(
                {
                    "step_s": step_s,
                    "rollout_s": generation["s"],
                    "train_s": step_s - generation["s"],
                    "tokens": generation["tokens"],
                    "response_tokens": generation["response_tokens"],
                }
            )

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            start = time.perf_counter()
            batch = super()._generate_and_score_completions(inputs)
            response = float(batch["completion_mask"].sum())
            generation.update(
                s=time.perf_counter() - start,
                response_tokens=response,
                tokens=response + float(batch["prompt_mask"].sum()),
            )
            return batch

    path = resolve_model_path(MODEL)
    config = GRPOConfig(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=PROMPTS * GROUP,
        num_generations=GROUP,
        max_completion_length=MAX_TOKENS,
        temperature=TEMPERATURE,
        learning_rate=LR,
        beta=0.0,
        num_iterations=1,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        seed=0,
    )
    trainer = TimedGRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
        processing_class=AutoTokenizer.from_pretrained(path),
        reward_funcs=_trl_reward,
        args=config,
        train_dataset=_trl_dataset(PROMPTS * GROUP * steps),
        callbacks=[Timer()],
    )
    trainer.train()
    (out / "steps.json").write_text(json.dumps(records))


def _mean(runs: list[list[dict]], key: str) -> float:
    """Mean of ``key`` over steps 2..N of every run (step 1 where a run has only one)."""
    return statistics.mean(r[key] for steps in runs for r in (steps[1:] or steps))


def _line(name: str, runs: list[list[dict]]) -> str:
    step, rollout, train, tokens = (_mean(runs, k) for k in ("step_s", "rollout_s", "train_s", "tokens"))
    return (
        f"{name:8s} step {step:6.2f} s  rollout {rollout:6.2f} s  train {train:6.2f} s  tokens {tokens:6.0f}  "
        f"response tokens {_mean(runs, 'response_tokens'):5.0f}  train ms/token {1e3 * train / tokens:6.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="steps a run (8: the issue's original measurement)")
    parser.add_argument("--rounds", type=int, default=1, help="product, TRL pairs, interleaved")
    parser.add_argument("--layout", choices=["single", "demo"], default="single")
    parser.add_argument("--trl-path", default=os.environ.get("GTPO_TRL_PATH"), help="folder holding trl")
    parser.add_argument("--override", action="append", default=[], help="extra key=value for the product")
    parser.add_argument("--workdir", help="keep the runs' outputs and logs here (default: a temporary folder)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return trl_child(Path(args.child), args.steps)
    print(f"load average before: {os.getloadavg()}")
    product, trl = [], []
    with contextlib.ExitStack() as stack:
        tmp = args.workdir or stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_vs_trl_"))
        Path(tmp).mkdir(parents=True, exist_ok=True)
        for index in range(args.rounds):
            product.append(product_run(args, Path(tmp) / f"product_{index}"))
            print(_line(f"product{index}", product[-1:]), flush=True)
            steps = trl_run(args, Path(tmp) / f"trl_{index}")
            if steps is None:
                break
            trl.append(steps)
            print(_line(f"trl{index}", trl[-1:]), flush=True)
    print(f"load average after: {os.getloadavg()}")
    print(_line("product", product))
    if trl:
        print(_line("trl", trl))
        ratio = {k: _mean(product, k) / _mean(trl, k) for k in ("step_s", "rollout_s", "train_s")}
        per_token = (_mean(product, "train_s") / _mean(product, "tokens")) / (
            _mean(trl, "train_s") / _mean(trl, "tokens")
        )
        print(
            f"product / TRL: step {ratio['step_s']:.3f}  rollout {ratio['rollout_s']:.3f}  train {ratio['train_s']:.3f}"
            f"  train per token {per_token:.3f}"
        )


if __name__ == "__main__":
    main()
