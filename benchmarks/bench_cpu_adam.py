"""torch's AdamW on the CPU as Megatron builds it (per-tensor loop) against its fused kernel (not a test).

Usage: ``python benchmarks/bench_cpu_adam.py [--layers 30] [--steps 5]``

The parameter shapes of SmolLM2-135M (the CPU demo's model; ``--layers`` fewer to save memory: each variant holds
parameters, gradients and two moments, 2.2 GB at 30 layers), fp32, the demo's lr; both variants start from the same
values and take the same gradients, interleaved step by step. Prints each variant's median wall and process CPU
seconds a step (the CPU time is the steadier on a shared machine), their ratio, and the largest difference of the
parameters after the last step (fp32 rounding: the kernels order the same update's operations differently).
``megatron_adapter.optimizer.fuse_cpu_adam`` switches the product's optimizer to the fused kernel.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

HIDDEN, QKV, FFN, VOCAB = 576, 960, 1536, 49152


def shapes(layers: int) -> list[tuple[int, ...]]:
    """SmolLM2-135M's parameter shapes (tied embedding; fused QKV and gate/up as Megatron holds them)."""
    layer = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * FFN, HIDDEN), (HIDDEN, FFN), (HIDDEN,), (HIDDEN,)]
    return [(VOCAB, HIDDEN), *(s for _ in range(layers) for s in layer), (HIDDEN,)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=gen) for s in shapes(args.layers)]
    variants = {}
    for name, fused in (("per-tensor", None), ("fused", True)):
        params = [torch.nn.Parameter(p.clone()) for p in start]
        variants[name] = (params, torch.optim.AdamW(params, lr=2e-5, weight_decay=0.0, fused=fused))
    times = {name: [] for name in variants}
    for _ in range(args.steps):
        grads = [torch.randn(p.shape, generator=gen) * 1e-3 for p in start]
        for name, (params, optimizer) in variants.items():
            for param, grad in zip(params, grads):
                param.grad = grad
            wall, cpu = time.perf_counter(), time.process_time()
            optimizer.step()
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    print(f"{sum(p.numel() for p in start) / 1e6:.1f} M fp32 parameters, {torch.get_num_threads()} threads")
    median = {
        name: [statistics.median(t[i] for t in steps[1:] or steps) for i in (0, 1)] for name, steps in times.items()
    }
    for name, (wall, cpu) in median.items():
        print(f"  {name:10s} wall {wall:.3f} s  CPU {cpu:.3f} s a step")
    ratio = [median["per-tensor"][i] / median["fused"][i] for i in (0, 1)]
    diff = max((a - b).abs().max().item() for a, b in zip(variants["per-tensor"][0], variants["fused"][0]))
    print(f"  per-tensor / fused: wall {ratio[0]:.2f}x  CPU {ratio[1]:.2f}x; max |difference| {diff:.1e}")


if __name__ == "__main__":
    main()
