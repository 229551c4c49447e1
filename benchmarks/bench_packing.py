"""Benchmark: the training phase on skewed sequence lengths, rows padded to the step's longest vs a token budget.

Usage: ``python benchmarks/bench_packing.py [--rows 32] [--tail 4] [--micro-batch-size 4] [--repeats 2]
[--threads 2]``

One ``MegatronPolicy.forward_backward`` (builtin:tiny-llama, fp32, TP=1, a gloo world of one, chunked log-prob op)
on one batch, in three ways, each in a fresh process:

- ``rows``: today's default, ``optim.micro_batch_size`` rows a micro-batch, every row padded to the step's longest;
- ``budget``: ``optim.max_tokens_per_micro_batch`` = ``micro_batch_size x longest`` (the same worst-case micro-batch),
  each micro-batch padded to its own longest;
- ``packed``: the same budget with ``optim.packing`` (several sequences a row, block-diagonal attention).

Lengths (seeded): ``rows - tail`` sequences shaped like the CPU demo's (prompts of 100-200 tokens, completions of
8-64) and ``tail`` long reasoning traces of 400-1000 tokens. Time: the best of ``repeats`` passes after a warm-up.
Memory: peak resident anonymous memory above the baseline taken after the model and batch exist (sampled every
0.5 ms, ``bench_logprobs.PeakSampler``). Ratios are against ``rows``, measured in this one run; the values are equal
(``tests/distributed/test_packing_parity.py``), printed here as the loss. Measured: docs/performance.md ("CPU:
token-budget micro-batches and packing").
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

import torch
from bench_logprobs import PeakSampler, anon_rss_bytes, free_port

MODES = ("rows", "budget", "packed")


def skewed_lengths(rows: int, tail: int, seed: int = 0) -> list[int]:
    """Prompt + completion tokens: demo-like sequences, then ``tail`` long traces (shuffled)."""
    rng = random.Random(seed)
    lengths = [rng.randint(100, 200) + rng.randint(8, 64) for _ in range(rows - tail)]
    lengths += [rng.randint(400, 1000) for _ in range(tail)]
    rng.shuffle(lengths)
    return lengths


def _batch(lengths: list[int]):
    from gtpo_megatron.batch import TrainBatch

    gen = torch.Generator().manual_seed(1)
    columns = torch.arange(max(lengths))
    token_mask = columns[None] < torch.tensor(lengths)[:, None]
    response_mask = token_mask & (columns[None] >= 100)
    return TrainBatch(
        input_ids=torch.randint(0, 49152, token_mask.shape, generator=gen) * token_mask,
        token_mask=token_mask,
        response_mask=response_mask,
        advantages=torch.randn(len(lengths), generator=gen),
    )


def _worker(args) -> dict:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    from gtpo_megatron.config import ModelConfig, OptimConfig
    from gtpo_megatron.megatron_adapter.policy import MegatronPolicy
    from gtpo_megatron.megatron_adapter.settings import PolicySettings
    from gtpo_megatron.ops import LossSpec
    from gtpo_megatron.parallel.groups import init_distributed

    lengths = skewed_lengths(args.rows, args.tail)
    budget = {}
    if args.worker != "rows":
        budget = {
            "max_tokens_per_micro_batch": args.micro_batch_size * max(lengths),
            "packing": args.worker == "packed",
        }
    groups = init_distributed(tp_size=1)
    settings = PolicySettings(
        model=ModelConfig(name_or_path="builtin:tiny-llama", params_dtype="float32"),
        optim=OptimConfig(micro_batch_size=args.micro_batch_size, clip_grad=1.0, **budget), logprob_chunk_size=1024,
    )  # fmt: skip
    policy = MegatronPolicy.from_pretrained(settings, groups=groups)
    loss = LossSpec(loss_name="gtpo", aggregation="seq-mean-token-mean", clip_eps_low=0.2, clip_eps_high=0.2)
    batch = _batch(lengths)
    policy.forward_backward(batch, loss)  # warm-up
    policy.zero_grad()
    baseline, sampler, seconds = anon_rss_bytes(), PeakSampler(), []
    sampler.start()
    for _ in range(args.repeats):
        start = time.perf_counter()
        metrics = policy.forward_backward(batch, loss)
        seconds.append(time.perf_counter() - start)
        policy.zero_grad()
    return {"seconds": min(seconds), "peak_extra_bytes": sampler.stop() - baseline, **metrics}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--tail", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.worker:
        print(json.dumps(_worker(args)))
        return
    lengths = skewed_lengths(args.rows, args.tail)
    print(
        f"{args.rows} sequences, {sum(lengths)} tokens, lengths {min(lengths)}-{max(lengths)}; rows mode: "
        f"{args.micro_batch_size} rows x {max(lengths)} a micro-batch; budget {args.micro_batch_size * max(lengths)}"
    )
    print(f"{'mode':<8}{'micro-batches':>14}{'padding':>9}{'train s':>9}{'x rows':>8}{'peak GiB':>10}{'x rows':>8}"
          f"{'loss':>14}")  # fmt: skip
    base = None
    for mode in MODES:
        flags = ["--rows", str(args.rows), "--tail", str(args.tail), "--micro-batch-size", str(args.micro_batch_size),
                 "--repeats", str(args.repeats), "--threads", str(args.threads)]  # fmt: skip
        done = subprocess.run([sys.executable, __file__, "--worker", mode, *flags], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"mode {mode} failed:\n{done.stderr[-3000:]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        base = base or result
        print(
            f"{mode:<8}{result['perf/micro_batches']:>14.0f}{result['perf/padding_frac']:>9.3f}"
            f"{result['seconds']:>9.2f}{result['seconds'] / base['seconds']:>8.2f}"
            f"{result['peak_extra_bytes'] / 2**30:>10.2f}{result['peak_extra_bytes'] / base['peak_extra_bytes']:>8.2f}"
            f"{result['loss']:>14.8f}"
        )


if __name__ == "__main__":
    main()
