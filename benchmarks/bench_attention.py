"""Core attention of the local layer spec: Megatron's ``DotProductAttention`` vs ``SDPAttention`` (not a test).

Usage: ``python benchmarks/bench_attention.py [--seq 160] [--rows 8] [--repeats 20]``

The CPU demo's shapes by default (SmolLM2-135M: 9 heads of 64 in 3 KV groups; 8 rows a rank of about 100 prompt +
60 response tokens), fp32, forward and backward of the same q, k, v through both modules, interleaved in one run;
prints each module's median seconds and their ratio, and the largest difference of their outputs.
"""

from __future__ import annotations

import argparse
import statistics
import time
import types

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from gtpo_megatron.megatron_adapter.cpu_compat import cuda_to_cpu_mode, install_cpu_compat
from gtpo_megatron.megatron_adapter.sdpa_attention import sdpa_attention_class

HEADS, GROUPS, HEAD_DIM = 9, 3, 64


def build(cls):
    """One core attention module of class ``cls`` at the demo's head layout (TP 1)."""
    config = TransformerConfig(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                               num_query_groups=GROUPS, kv_channels=HEAD_DIM, attention_dropout=0.0,
                               use_cpu_initialization=True)  # fmt: skip
    tp = types.SimpleNamespace(tp=types.SimpleNamespace(size=lambda: 1))
    return cls(config, 1, AttnMaskType.causal, "self", pg_collection=tp)


def step_s(module, q, k, v, mask) -> float:
    """Seconds of one forward and backward of ``module``."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    start = time.perf_counter()
    module(q, k, v, mask).sum().backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=160)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    install_cpu_compat()
    parallel_state._set_global_memory_buffer()  # DotProductAttention's score buffer, as initialize_model_parallel
    get_cuda_rng_tracker().add("model-parallel-rng", 0)  # its dropout's RNG (p = 0), as model_parallel_cuda_manual_seed
    megatron, sdpa = build(DotProductAttention), build(sdpa_attention_class())
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(args.seq, args.rows, HEADS, HEAD_DIM, generator=gen)
    k, v = (torch.randn(args.seq, args.rows, GROUPS, HEAD_DIM, generator=gen) for _ in range(2))
    causal = torch.triu(torch.ones(args.seq, args.seq, dtype=torch.bool), diagonal=1)[None, None]
    times = {"megatron": [], "sdpa": []}
    with cuda_to_cpu_mode():
        for _ in range(args.repeats):
            times["megatron"].append(step_s(megatron, q, k, v, causal))
            times["sdpa"].append(step_s(sdpa, q, k, v, None))
        diff = (megatron(q, k, v, causal) - sdpa(q, k, v, None)).abs().max().item()
    median = {name: statistics.median(t) for name, t in times.items()}
    print(f"seq {args.seq}, rows {args.rows}, fp32, forward + backward, median of {args.repeats}:")
    print(f"  DotProductAttention {median['megatron'] * 1e3:8.2f} ms   SDPAttention {median['sdpa'] * 1e3:8.2f} ms   "
          f"ratio {median['megatron'] / median['sdpa']:.2f}x   max |diff| {diff:.2e}")  # fmt: skip


if __name__ == "__main__":
    main()
