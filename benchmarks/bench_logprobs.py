"""Benchmark: fused vocab-parallel log-probs + entropy vs the naive path at a Qwen-sized vocabulary (not a test).

Usage: ``python benchmarks/bench_logprobs.py [--tokens 8192] [--vocab 151936] [--chunk-size 256] [--dtype fp32]
[--threads 2] [--repeats 3] [--entropy-grad]``

Variants, each forward + backward of ``sum(g * logprobs)`` with the entropy computed and detached (GTPO's use,
docs/algorithm.md section 4; ``--entropy-grad`` adds ``+ sum(entropy)`` to the loss in every variant):
- ``naive``: ``log_softmax(logits.float())``, ``gather``, ``-sum(p * log p)`` on the full vocabulary (TP=1).
- ``fused``: ``vocab_parallel_logprobs_entropy(..., chunk_size=C)`` on the full vocabulary (TP=1).
- ``fused-tp2``: the same op at TP=2 as a real 2-process gloo run (each rank holds ``[N, V/2]``, one thread
  each; the two all-reduces are ``[N]``/``[3, N]`` fp32 vectors). Reported per rank.

Memory method (torch has no CPU allocator statistics): every variant runs in a fresh subprocess (fresh ranks for
``fused-tp2``). After imports, a small warm-up and the allocation of the inputs, the worker reads its resident
ANONYMOUS memory (``RssAnon`` in ``/proc/self/status``: heap, i.e. tensors, excluding file-backed library pages,
which the kernel may drop and re-fault under memory pressure and which made ``ru_maxrss`` deltas unreliable on
this shared machine). During ONE forward+backward a thread samples ``RssAnon`` every 0.5 ms (tensor kernels
release the GIL); peak extra memory = sampled maximum - baseline: every byte of intermediates and the logits
gradient at the peak, independent of allocator caching (buffers live for milliseconds, far above the sampling
period). The "work" column subtracts the logits gradient (the same size in every variant), leaving
the computation's own working set. Time is the best of ``--repeats`` further forward+backward runs (wall clock;
on a shared machine, compare runs taken at the same load).

Chunk size: 256 tokens by default (two fp32 buffers of 256 x V/tp = 2 x 156 MB at TP=1). With two torch threads
on this 2-core machine, chunks of 16 paid an OpenMP barrier per small op and ran slower than the naive path when
the machine was shared; with one thread per process chunks of 8-32 were as fast as 256.

Roofline: three passes over the logits (forward max, forward softmax statistics, backward recompute+gradient) at
this machine's measured read bandwidth (best of 3 ``sum()`` reductions over a 1 GiB fp32 buffer). The fraction is
``roofline time / measured time`` and "achieved" is ``3 * logits bytes / measured time``.

Compute floor: ``exp`` and ``log`` throughput of this CPU (fp32, in cache, ``--threads`` threads and 1) and the op's
count of them, :data:`EXPS_PER_ELEMENT` ``exp`` per logit and three ``log`` per token: the time below which no
implementation that evaluates them with torch's vectorised kernels can go ("exp floor" = floor / measured time).

The naive path needs about 3-5x the logits in extra memory; when that does not fit in half of ``MemAvailable`` it
runs at the largest ``tokens / 2^k`` that fits, the fused op is ALSO measured at that size for like-for-like
ratios, and the naive numbers at ``--tokens`` are extrapolated linearly (both time and memory are linear in N);
the output labels them as such.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def anon_rss_bytes() -> int:
    """Resident anonymous memory (``RssAnon``): heap and tensors only, not re-faulted library pages."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("RssAnon not found in /proc/self/status")


class PeakSampler(threading.Thread):
    """Samples ``RssAnon`` every 0.5 ms (tensor ops release the GIL) and keeps the maximum."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = anon_rss_bytes()
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(0.0005):
            self.peak = max(self.peak, anon_rss_bytes())

    def stop(self) -> int:
        self._stop_event.set()
        self.join()
        return max(self.peak, anon_rss_bytes())


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable not found in /proc/meminfo")


ENTROPY_GRAD = "--entropy-grad" in sys.argv


def _naive(logits, targets, grad_out, _chunk, _group):
    logp = torch.log_softmax(logits.float(), dim=-1)
    logprobs = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    with torch.set_grad_enabled(ENTROPY_GRAD):
        entropy = -(logp.exp() * logp).sum(dim=-1)
    loss = (logprobs * grad_out).sum() + (entropy.sum() if ENTROPY_GRAD else 0.0)
    loss.backward()
    return entropy


def _fused(logits, targets, grad_out, chunk, group):
    from gtpo_megatron.ops import vocab_parallel_logprobs_entropy

    logprobs, entropy = vocab_parallel_logprobs_entropy(
        logits, targets, tp_group=group, chunk_size=chunk, entropy_requires_grad=ENTROPY_GRAD
    )
    loss = (logprobs * grad_out).sum() + (entropy.sum() if ENTROPY_GRAD else 0.0)
    loss.backward()
    return entropy


def _measure(fn, tokens, width, vocab_offset, vocab, dtype, chunk, repeats, group=None) -> dict:
    gen = torch.Generator().manual_seed(0)
    fn(
        torch.randn(4, width, dtype=dtype, requires_grad=True),
        torch.zeros(4, dtype=torch.long),
        torch.ones(4),
        chunk,
        group,
    )  # warm-up: lazy kernels and thread pools out of the measurement
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    grad_out = torch.randn(tokens, generator=gen)
    logits = torch.empty(tokens, width, dtype=dtype)
    for a in range(0, tokens, 64):  # fill in slices: no full-size temporary before the baseline
        logits[a : a + 64] = torch.randn(min(64, tokens - a), vocab, generator=gen, dtype=dtype)[
            :, vocab_offset : vocab_offset + width
        ]
    logits.requires_grad_()
    baseline = anon_rss_bytes()
    sampler = PeakSampler()
    sampler.start()
    fn(logits, targets, grad_out, chunk, group)
    peak_extra = sampler.stop() - baseline
    times = []
    for _ in range(repeats):
        logits.grad = None
        start = time.perf_counter()
        fn(logits, targets, grad_out, chunk, group)
        times.append(time.perf_counter() - start)
    logits_bytes = logits.numel() * logits.element_size()
    return {"time_s": min(times), "peak_extra_bytes": peak_extra, "logits_bytes": logits_bytes}


def _tp2_rank(rank, args, port, out_path):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    width = args.vocab // 2
    result = _measure(
        _fused,
        args.tokens,
        width,
        rank * width,
        args.vocab,
        DTYPES[args.dtype],
        args.chunk_size,
        args.repeats,
        group=dist.group.WORLD,
    )
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def _worker(args) -> dict:
    if args.worker == "fused-tp2":
        import tempfile

        import torch.multiprocessing as mp

        out = tempfile.mktemp(prefix="bench_tp2_")
        mp.spawn(_tp2_rank, args=(args, free_port(), out), nprocs=2, join=True)
        ranks = [json.load(open(f"{out}.{r}")) for r in range(2)]
        return {
            "time_s": max(r["time_s"] for r in ranks),
            "logits_bytes": ranks[0]["logits_bytes"],
            "peak_extra_bytes": max(r["peak_extra_bytes"] for r in ranks),
        }
    fn = _naive if args.worker == "naive" else _fused
    return _measure(fn, args.tokens, args.vocab, 0, args.vocab, DTYPES[args.dtype], args.chunk_size, args.repeats)


def _wait_for_memory(needed: float, timeout_s: float = 180.0) -> None:
    """On a shared machine, wait until ``needed`` bytes are available rather than risk the OOM killer."""
    deadline = time.monotonic() + timeout_s
    while _mem_available() < needed:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"only {_mem_available() / 2**30:.1f} GiB available, {needed / 2**30:.1f} GiB needed; "
                "retry with a smaller --tokens"
            )
        time.sleep(2.0)


def _run_variant(variant: str, tokens: int, args) -> dict:
    logits_bytes = tokens * args.vocab * torch.tensor([], dtype=DTYPES[args.dtype]).element_size()
    _wait_for_memory((7 * tokens * args.vocab * 4 if variant == "naive" else 2.2 * logits_bytes) + 2**30)
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        variant,
        "--tokens",
        str(tokens),
        "--vocab",
        str(args.vocab),
        "--chunk-size",
        str(args.chunk_size),
        "--dtype",
        args.dtype,
        "--repeats",
        str(args.repeats),
        "--threads",
        str(args.threads),
    ] + (["--entropy-grad"] if args.entropy_grad else [])
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"variant {variant} at N={tokens} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _elementwise_rate(fn_name: str, threads: int) -> float:
    """fp32 elements/s of ``torch.exp`` or ``torch.log`` on ``threads`` threads, in cache (2 x 1 MiB buffers).

    The best of 40 runs of 10 calls (on a shared machine the best run is the nearest to an idle one): the compute,
    not the memory, of one transcendental per element.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    x = -20 * torch.rand(2**18) if fn_name == "exp" else torch.rand(2**18) + 1e-3
    out, fn = torch.empty_like(x), getattr(torch, fn_name)
    fn(x, out=out)
    best = min(_timed(lambda: [fn(x, out=out) for _ in range(10)]) for _ in range(40))
    torch.set_num_threads(previous)
    return 10 * x.numel() / best


EXPS_PER_ELEMENT = 2
"""``exp`` calls per logit in one forward + backward of the fused op (one in the forward statistics, one in the
backward softmax; a separate entropy temperature adds one per pass that uses it). ``log``: per token only."""
NAIVE_EXPS_PER_ELEMENT = 3
"""The naive path's: inside ``log_softmax``, ``logp.exp()`` for the entropy, and ``log_softmax``'s backward."""


def _read_bandwidth() -> float:
    buf = torch.ones(2**28)  # 1 GiB fp32, touched
    best = min(_timed(buf.sum) for _ in range(3))
    return buf.numel() * 4 / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _naive_tokens(args) -> int:
    bytes_per_token = args.vocab * 4 * 7  # logits(fp32 view) + ~5x intermediates + gradient
    tokens = args.tokens
    while tokens > 256 and tokens * bytes_per_token > 0.5 * _mem_available():
        tokens //= 2
    return tokens


def _report(rows: list[tuple[str, int, dict]], naive: dict, bandwidth: float, exp_rates: dict[int, float],
            itemsize: int) -> None:  # fmt: skip
    """One line per variant; ``roofline`` and ``exp floor`` are fractions (limit time / measured time)."""
    gib = 2**30
    naive_work = naive["peak_extra_bytes"] - naive["logits_bytes"]
    print(
        f"{'variant':<32}{'N':>6}{'time s':>8}{'extra GiB':>10}{'x logits':>9}{'time/naive':>11}"
        f"{'mem/naive':>10}{'work/naive':>11}{'roofline':>9}{'GB/s':>6}{'exp floor':>10}"
    )
    for name, tokens, r in rows:
        scale = tokens / naive["tokens"]
        work = r["peak_extra_bytes"] - r["logits_bytes"]
        exps = NAIVE_EXPS_PER_ELEMENT if name.startswith("naive") else EXPS_PER_ELEMENT
        floor_s = exps * r["logits_bytes"] / itemsize / exp_rates[1 if "tp2" in name else 0]
        print(
            f"{name:<32}{tokens:>6}{r['time_s']:>8.3f}{r['peak_extra_bytes'] / gib:>10.2f}"
            f"{r['peak_extra_bytes'] / r['logits_bytes']:>9.2f}{r['time_s'] / (naive['time_s'] * scale):>11.3f}"
            f"{r['peak_extra_bytes'] / (naive['peak_extra_bytes'] * scale):>10.3f}"
            f"{work / (naive_work * scale):>11.3f}{3 * r['logits_bytes'] / bandwidth / r['time_s']:>9.2f}"
            f"{3 * r['logits_bytes'] / r['time_s'] / 1e9:>6.1f}{floor_s / r['time_s']:>10.2f}"
        )


def _fused_tokens(args) -> int:
    tokens = args.tokens
    while (
        tokens > 256
        and 2.2 * tokens * args.vocab * torch.tensor([], dtype=DTYPES[args.dtype]).element_size()
        > 0.8 * _mem_available()
    ):
        tokens //= 2
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads",
        type=int,
        default=torch.get_num_threads(),
        help="torch threads of the TP=1 variants (each TP=2 rank uses 1)",
    )
    parser.add_argument(
        "--entropy-grad",
        action="store_true",
        help="also backpropagate through the entropy (an entropy bonus; GTPO detaches it)",
    )
    parser.add_argument("--worker", choices=["naive", "fused", "fused-tp2"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.worker:
        print(json.dumps(_worker(args)))
        return
    bandwidth = _read_bandwidth()
    rates = {name: (_elementwise_rate(name, args.threads), _elementwise_rate(name, 1)) for name in ("exp", "log")}
    load = os.getloadavg()
    small, large = _naive_tokens(args), _fused_tokens(args)
    if large != args.tokens:
        print(f"note: N={args.tokens} does not fit in 80% of MemAvailable for the fused op; using N={large}")
    naive = dict(_run_variant("naive", small, args), tokens=small)
    rows = [("naive (log_softmax) TP=1", small, naive)]
    for tokens in sorted({small, large}):
        rows.append((f"fused chunk={args.chunk_size} TP=1", tokens, _run_variant("fused", tokens, args)))
        rows.append((f"fused-tp2 chunk={args.chunk_size} per rank", tokens, _run_variant("fused-tp2", tokens, args)))
    print(
        f"V={args.vocab} dtype={args.dtype} threads={args.threads} entropy_grad={args.entropy_grad} "
        f"read bandwidth={bandwidth / 1e9:.1f} GB/s; roofline = 3 passes over the (per-rank) logits; "
        "'work' = peak extra minus the logits gradient (same size in every variant)"
    )
    if small != large:
        print(
            f"naive measured at N={small} (N={large} needs more than half of MemAvailable); ratios at N={large} "
            f"use the naive numbers scaled linearly by {large / small:g}"
        )
    elements = args.tokens * args.vocab
    print(
        f"load average (1, 5, 15 min) at the start: {load[0]:.1f}, {load[1]:.1f}, {load[2]:.1f}; after: "
        + ", ".join(f"{x:.1f}" for x in os.getloadavg())
    )
    print(
        f"compute (fp32, in cache): exp {rates['exp'][0] / 1e9:.2f} G elements/s on {args.threads} threads "
        f"({rates['exp'][1] / 1e9:.2f} on 1), log {rates['log'][0] / 1e9:.2f} ({rates['log'][1] / 1e9:.2f} on 1); "
        f"the op needs {EXPS_PER_ELEMENT} exp per logit and 3 log per token: at N={args.tokens}, V={args.vocab} "
        f"the exp floor is {EXPS_PER_ELEMENT * elements / rates['exp'][0]:.3f} s (+ "
        f"{3 * args.tokens / rates['log'][0] * 1e3:.3f} ms of log), the bandwidth roofline (3 passes) "
        f"{3 * elements * DTYPES[args.dtype].itemsize / bandwidth:.3f} s; 'exp floor' below = floor / time"
    )
    _report(rows, naive, bandwidth, {0: rates["exp"][0], 1: rates["exp"][1]}, DTYPES[args.dtype].itemsize)


if __name__ == "__main__":
    main()
