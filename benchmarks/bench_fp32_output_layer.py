"""Benchmark: memory of the fp32 output layer (``megatron_adapter.output_layer``) at a realistic vocabulary.

Usage: ``python benchmarks/bench_fp32_output_layer.py [--tokens 1024] [--vocab 151936] [--hidden 2048]
[--chunk-size 256] [--threads 2]``

One forward + backward of the last-stage head: bf16 hidden states ``[n, 1, h]`` -> Megatron's
``ColumnParallelLinear`` output layer (bf16 weight ``[V, h]``, TP=1) -> ``vocab_parallel_logprobs_entropy``
(chunked, entropy detached) -> ``sum(logprobs)``. Variants, each in a fresh process (a gloo world of one):
- ``bf16``: the stock layer (bf16 logits);
- ``fp32``: ``use_fp32_output_layer`` (fp32 logits; the saved-tensor hook keeps the bf16 originals for backward);
- ``fp32-no-hook``: the same fp32 casts without the hook (autograd keeps the fp32 copies of the weight and of the
  hidden states until backward): what the hook saves.
Memory: peak resident anonymous memory (``RssAnon``, sampled every 0.5 ms, see ``bench_logprobs.py``) above the
baseline taken after the inputs and weights exist (the logits live only in the autograd graph, as in Megatron's
schedule). "planner" is ``plan.memory.logprob_working_set_bytes``, the planner's rule: for bf16 logits
``logits_bytes`` (logits + gradient in the logits dtype + the op's two fp32 ``[chunk, V]`` buffers); for fp32 logits
``max(logits_bytes(param_bytes=4), 4*n*V + 10*V*h)``: the op phase, or the output layer's backward (fp32 logits
gradient, fp32 weight cast, fp32 weight gradient and its bf16 cast). Measured here (2 threads, shared machine):
n=1024, h=2048: bf16 0.87 GiB, fp32 2.92 (the layer's backward is the peak; the hook changes nothing);
n=4096, h=1024: bf16 2.54, fp32 4.65, fp32 without the hook 5.24 (the op phase is the peak and the hook
keeps the fp32 weight cast out of it). The log-prob precision of the same switch is measured by
``tests/distributed/test_fp32_output_layer.py`` (printed).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch
from bench_logprobs import PeakSampler, anon_rss_bytes, free_port

VARIANTS = ("bf16", "fp32", "fp32-no-hook")


def _no_hook_fp32(layer) -> None:
    """fp32 casts into Megatron's linear function without the saved-tensor hook (comparison only)."""
    linear_impl = layer._forward_impl

    def forward_impl(input, weight, *args, **kwargs):  # noqa: A002 (Megatron's keyword)
        return linear_impl(input.float(), weight.float(), *args, **kwargs)

    layer._forward_impl = forward_impl


def _worker(args) -> dict:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer import TransformerConfig

    from gtpo_megatron.megatron_adapter.cpu_compat import cuda_to_cpu_mode, install_cpu_compat
    from gtpo_megatron.megatron_adapter.output_layer import use_fp32_output_layer
    from gtpo_megatron.ops import vocab_parallel_logprobs_entropy
    from gtpo_megatron.parallel.groups import init_distributed

    install_cpu_compat()
    init_distributed(tp_size=1)
    config = TransformerConfig(
        num_layers=1,
        hidden_size=args.hidden,
        num_attention_heads=8,
        bf16=True,
        params_dtype=torch.bfloat16,
        use_cpu_initialization=True,
    )
    with cuda_to_cpu_mode():
        layer = ColumnParallelLinear(
            args.hidden, args.vocab, config=config, init_method=torch.nn.init.zeros_, bias=False, gather_output=False
        )
    layer.weight.data.normal_(0, 0.02)
    {"fp32": use_fp32_output_layer, "fp32-no-hook": _no_hook_fp32}.get(args.worker, lambda _: None)(layer)
    targets = torch.randint(0, args.vocab, (args.tokens, 1))

    def loss_of(hidden):  # the logits live on only in the autograd graph, as in Megatron's schedule
        logits, _ = layer(hidden)
        logprobs, _ = vocab_parallel_logprobs_entropy(logits, targets[: hidden.shape[0]], chunk_size=args.chunk_size)
        return logprobs.sum(), str(logits.dtype)

    loss_of(torch.randn(8, 1, args.hidden, dtype=torch.bfloat16, requires_grad=True))[0].backward()  # warm-up
    layer.weight.grad = None
    hidden = torch.randn(args.tokens, 1, args.hidden, dtype=torch.bfloat16, requires_grad=True)
    baseline = anon_rss_bytes()
    sampler = PeakSampler()
    sampler.start()
    loss, dtype = loss_of(hidden)
    loss.backward()
    return {"peak_extra_bytes": sampler.stop() - baseline, "logits_dtype": dtype}


def _planned(args, variant: str) -> int:
    """The planner's bytes for ``variant`` (``plan.memory.logprob_working_set_bytes``, the one owner of the rule).

    bf16 logits for ``bf16``; the fp32 output layer's rule otherwise (the larger of the op phase with fp32 logits
    and the output layer's backward).
    """
    from gtpo_megatron.plan.memory import logprob_working_set_bytes

    return logprob_working_set_bytes(
        args.vocab,
        tokens=args.tokens,
        hidden_size=args.hidden,
        param_bytes=2,
        chunk_size=args.chunk_size,
        fp32_output_layer=variant != "bf16",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.worker:
        print(json.dumps(_worker(args)))
        return
    gib = 2**30
    weight_gib = args.vocab * args.hidden * 2 / gib
    print(
        f"n={args.tokens} tokens, V={args.vocab}, h={args.hidden}, chunk={args.chunk_size}, TP=1; "
        f"logits {args.tokens * args.vocab * 2 / gib:.2f} GiB in bf16, weight {weight_gib:.2f} GiB in bf16"
    )
    print(f"{'variant':<14}{'logits':>9}{'peak extra GiB':>16}{'planner GiB':>13}{'x bf16':>8}")
    base = None
    for variant in VARIANTS:
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            variant,
            "--tokens",
            str(args.tokens),
            "--vocab",
            str(args.vocab),
            "--hidden",
            str(args.hidden),
            "--chunk-size",
            str(args.chunk_size),
            "--threads",
            str(args.threads),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"variant {variant} failed:\n{done.stderr[-3000:]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        base = base or result["peak_extra_bytes"]
        print(
            f"{variant:<14}{result['logits_dtype'].replace('torch.', ''):>9}"
            f"{result['peak_extra_bytes'] / gib:>16.2f}{_planned(args, variant) / gib:>13.2f}"
            f"{result['peak_extra_bytes'] / base:>8.2f}"
        )


if __name__ == "__main__":
    main()
