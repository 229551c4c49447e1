"""torch.profiler of one training step of the CPU demo: ``gtpo-train``'s and TRL's, on the same batch (not a test).

Usage: ``python benchmarks/profile_train_step.py [--trl-path DIR] [--threads 2] [--top 12]``

The product part runs ``gtpo-train`` on ``configs/cpu_demo.yaml`` at TP 1 in this process for 2 steps and profiles
step 2's ``MegatronPolicy.train_step``; it saves that step's batch, and a fresh process (``--trl-path`` or
``$GTPO_TRL_PATH`` on its ``PYTHONPATH``) runs TRL's GRPOTrainer loss, backward and optimizer on the same 16 rows
(one forward of all rows, TRL's layout; one warm-up step, then the profiled one). Both print the same table: wall
seconds of each phase from ``record_function`` ranges (forward by module kind, the loss, backward, optimizer, and
the host time outside them) and the ops with the most self CPU time.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

KINDS = {  # module name suffix -> forward range (product's Megatron names, TRL's HF names)
    "embedding": "fwd/embedding",
    "embed_tokens": "fwd/embedding",
    "self_attention": "fwd/attention block",
    "self_attn": "fwd/attention block",
    "core_attention": "fwd/attention core",
    "linear_qkv": "fwd/attention projections",
    "linear_proj": "fwd/attention projections",
    "q_proj": "fwd/attention projections",
    "k_proj": "fwd/attention projections",
    "v_proj": "fwd/attention projections",
    "o_proj": "fwd/attention projections",
    "mlp": "fwd/MLP",
    "output_layer": "fwd/output layer",
    "lm_head": "fwd/output layer",
    "input_layernorm": "fwd/norms",
    "pre_mlp_layernorm": "fwd/norms",
    "post_attention_layernorm": "fwd/norms",
    "final_layernorm": "fwd/norms",
    "norm": "fwd/norms",
}
PHASES = [
    "step",
    "forward",
    "fwd/model",
    "fwd/embedding",
    "fwd/attention block",
    "fwd/attention projections",
    "fwd/attention core",
    "fwd/MLP",
    "fwd/norms",
    "fwd/output layer",
    "loss",
    "backward",
    "optimizer",
]


def range_hooks(model: torch.nn.Module) -> None:
    """A ``record_function`` range around the forward of ``model`` and of its modules named by a ``KINDS`` key."""
    for name, module in model.named_modules():
        kind = "fwd/model" if name == "" else KINDS.get(name.rsplit(".", 1)[-1])
        if kind is None:
            continue

        def pre(_module, _inputs, kind=kind):
            _module._profile_range = record_function(kind)
            _module._profile_range.__enter__()

        def post(_module, _inputs, _output):
            _module._profile_range.__exit__(None, None, None)

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)


def wrapped(fn, name: str):
    """``fn`` inside a ``record_function(name)`` range."""

    def inner(*args, **kwargs):
        with record_function(name):
            return fn(*args, **kwargs)

    return inner


def report(prof, title: str, top: int) -> None:
    """The phase table (wall seconds of each range, summed over calls) and the top ops by self CPU time."""
    events = {e.key: e for e in prof.key_averages()}
    seconds = {p: events[p].cpu_time_total / 1e6 if p in events else 0.0 for p in PHASES}
    seconds["forward outside the model"] = seconds["forward"] - seconds["fwd/model"]
    seconds["host outside the phases"] = (
        seconds["step"] - seconds["forward"] - seconds["backward"] - seconds["optimizer"]
    )
    print(f"== {title}: wall seconds per phase (record_function ranges, summed over micro-batches)")
    for phase, value in seconds.items():
        print(f"   {phase:28s} {value:8.3f}")
    print(f"== {title}: top {top} ops by self CPU time")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=40))


def product(out: Path, threads: int, top: int) -> None:
    """``gtpo-train`` at TP 1 for 2 steps; profiles step 2's train step and saves its batch to ``out/batch.pt``."""
    from megatron.core.pipeline_parallel import schedules

    from gtpo_megatron.megatron_adapter import forward_step, policy
    from gtpo_megatron.train import main

    schedules.forward_step = wrapped(schedules.forward_step, "forward")
    schedules.backward_step = wrapped(schedules.backward_step, "backward")
    forward_step.token_logprobs_entropy = wrapped(forward_step.token_logprobs_entropy, "loss")
    forward_step.policy_objective = wrapped(forward_step.policy_objective, "loss")
    policy.optimizer_step = wrapped(policy.optimizer_step, "optimizer")
    train_step, calls = policy.MegatronPolicy.train_step, []

    def profiled(self, batch, loss):
        calls.append(1)
        if len(calls) == 1:
            range_hooks(self.model)
            return train_step(self, batch, loss)
        torch.save({"batch": batch, "threads": torch.get_num_threads()}, out / "batch.pt")
        with profile(activities=[ProfilerActivity.CPU]) as prof, record_function("step"):
            metrics = train_step(self, batch, loss)
        report(prof, f"product ({torch.get_num_threads()} threads)", top)
        return metrics

    policy.MegatronPolicy.train_step = profiled
    torch.set_num_threads(threads)
    config = str(ROOT / "configs/cpu_demo.yaml")
    main(
        [
            "--config",
            config,
            "parallel.tp_size=1",
            "model.pad_attention_heads=false",
            "trainer.max_steps=2",
            f"output_dir={out}/run",
            "logging.progress=false",
            "logging.wandb_mode=disabled",
            "checkpoint.every_n_steps=3",
        ]
    )


def trl_inputs(batch) -> dict:
    """TRL's training inputs for the rows of a ``TrainBatch``: left-padded prompts, right-padded completions."""
    rows = []
    for ids, tokens, response in zip(batch.input_ids, batch.token_mask, batch.response_mask):
        start = int(response.nonzero()[0]) if response.any() else int(tokens.sum())
        rows.append((ids[:start], ids[start : int(tokens.sum())]))
    prompt_len, completion_len = max(len(p) for p, _ in rows), max(len(c) for _, c in rows)
    prompt_ids = torch.zeros(len(rows), prompt_len, dtype=torch.long)
    prompt_mask, completion_ids = torch.zeros_like(prompt_ids), torch.zeros(len(rows), completion_len, dtype=torch.long)
    completion_mask = torch.zeros_like(completion_ids)
    for index, (prompt, completion) in enumerate(rows):
        prompt_ids[index, prompt_len - len(prompt) :], prompt_mask[index, prompt_len - len(prompt) :] = prompt, 1
        completion_ids[index, : len(completion)], completion_mask[index, : len(completion)] = completion, 1
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": batch.advantages.float(),
        "num_items_in_batch": completion_mask.sum(),
    }


def trl(out: Path, top: int) -> None:
    """TRL's loss, backward, gradient clip and optimizer step on ``out/batch.pt``: one warm-up, one profiled."""
    import bench_vs_trl as bench
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from gtpo_megatron.builtin_models import resolve_model_path

    saved = torch.load(out / "batch.pt", weights_only=False)
    torch.set_num_threads(saved["threads"])
    inputs, path = trl_inputs(saved["batch"]), resolve_model_path(bench.MODEL)
    config = GRPOConfig(
        output_dir=str(out / "trl"),
        per_device_train_batch_size=16,
        num_generations=bench.GROUP,
        max_completion_length=bench.MAX_TOKENS,
        temperature=bench.TEMPERATURE,
        learning_rate=bench.LR,
        beta=0.0,
        report_to=[],
        use_cpu=True,
        bf16=False,
        seed=0,
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model,
        processing_class=AutoTokenizer.from_pretrained(path),
        reward_funcs=bench._trl_reward,
        args=config,
        train_dataset=bench._trl_dataset(16),
    )
    trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop, read by the loss's normaliser
    model.train()
    range_hooks(model)

    def step():
        with record_function("forward"):
            loss = wrapped(trainer.compute_loss, "loss")(model, inputs)
        with record_function("backward"):
            loss.backward()
        with record_function("optimizer"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
            trainer.optimizer.step()
            trainer.optimizer.zero_grad()

    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof, record_function("step"):
        step()
    report(prof, f"TRL {type(trainer.optimizer).__name__} ({torch.get_num_threads()} threads)", top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trl-path", default=os.environ.get("GTPO_TRL_PATH"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--workdir", help="keep the run and the saved batch here (default: a temporary folder)")
    parser.add_argument("--only", choices=["product", "trl"], help="one side (trl: reuses --workdir's batch)")
    parser.add_argument("--child", choices=["product", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return (
            product(Path(args.out), args.threads, args.top)
            if args.child == "product"
            else trl(Path(args.out), args.top)
        )
    print(f"load average before: {os.getloadavg()}", flush=True)
    with contextlib.ExitStack() as stack:
        tmp = args.workdir or stack.enter_context(tempfile.TemporaryDirectory(prefix="profile_train_step_"))
        Path(tmp).mkdir(parents=True, exist_ok=True)
        for child, extra in (("product", None), ("trl", args.trl_path)):
            if args.only not in (None, child):
                continue
            paths = [p for p in (extra, str(ROOT), os.environ.get("PYTHONPATH")) if p]
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "WANDB_MODE": "disabled"}
            command = [
                sys.executable,
                __file__,
                "--child",
                child,
                "--out",
                tmp,
                "--threads",
                str(args.threads),
                "--top",
                str(args.top),
            ]
            code = subprocess.run(command, env=env, cwd=ROOT).returncode
            if code != 0:
                print(f"{child} failed with exit status {code} (-9: killed, e.g. by the OOM killer)", flush=True)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
