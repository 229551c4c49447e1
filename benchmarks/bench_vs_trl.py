"""TRL's GRPOTrainer on the CPU demo's workload, for a step-time comparison with ``gtpo-train``.

Same model folder (the built-in SmolLM2-135M-Instruct), the demo's prompts (built-in arithmetic task, the same
system prompt and chat template), 2 prompts x 8 completions per step, 64 new tokens, temperature 0.7, lr 2e-5,
fp32, beta 0 (no reference model), one update per batch. TRL generates with transformers (no vLLM on CPU in TRL).
Run it alone on the machine, in a venv with ``trl`` (it is not a dependency of the package):

    python benchmarks/bench_vs_trl.py --steps 6 [--model ~/.cache/gtpo_megatron/smollm2-135m-instruct]

Prints the mean step time of steps 2..N (step 1 includes warm-up) as ``trl/step_s``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _dataset(num_rows: int):
    from datasets import Dataset

    from gtpo_megatron.data.prompts import build_messages
    from gtpo_megatron.data.synthetic import generate_problems

    problems = generate_problems(num_rows, seed=0, split="train", difficulty="easy")
    return Dataset.from_list([{"prompt": build_messages(p.question), "answer": p.answer} for p in problems])


def _reward(completions, answer, **_):
    from gtpo_megatron.rewards.registry import get_reward

    score = get_reward("math_verify")
    return [float(score(completion=c[0]["content"], reference=a).score) for c, a in zip(completions, answer)]


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(Path.home() / ".cache/gtpo_megatron/smollm2-135m-instruct"))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--output", default="runs/bench_trl")
    args = parser.parse_args()

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.seconds, self._start = [], 0.0

        def on_step_begin(self, *a, **k):
            self._start = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.seconds.append(time.perf_counter() - self._start)

    cfg = GRPOConfig(
        output_dir=args.output,
        max_steps=args.steps,
        per_device_train_batch_size=16,
        num_generations=8,
        max_completion_length=64,
        temperature=0.7,
        learning_rate=2e-5,
        beta=0.0,
        num_iterations=1,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        seed=0,
    )
    timer = StepTimer()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model,
        processing_class=AutoTokenizer.from_pretrained(args.model),
        reward_funcs=_reward,
        args=cfg,
        train_dataset=_dataset(16 * args.steps),
        callbacks=[timer],
    )
    trainer.train()
    later = timer.seconds[1:] or timer.seconds
    print(
        f"trl/step_s {statistics.mean(later):.2f} (steps 2..{len(timer.seconds)}: "
        f"{[round(s, 1) for s in timer.seconds]})"
    )


if __name__ == "__main__":
    main()
