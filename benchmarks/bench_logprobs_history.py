"""Benchmark: the log-prob op at every commit that changed it, interleaved in one process (not a test).

Usage: ``python benchmarks/bench_logprobs_history.py [--tokens 2048] [--vocab 151936] [--chunk-size 256]
[--threads 2] [--rounds 9] [--commits SHA ...]``

Each version of ``gtpo_megatron/ops/logprobs.py`` (``git log --follow``, oldest first, plus the working tree) is
loaded from ``git show <sha>:<path>`` into a module of its own; a ``gtpo_megatron`` module it imports is loaded at
the same commit (so a sibling that changed since cannot leak in). Every round times one forward + backward of
``sum(g * logprobs)`` (entropy computed and detached, GTPO's use) for the naive ``log_softmax`` path and then every
version, in the same order, on the same fp32 logits: the load of a shared machine hits all versions alike. The
table gives each variant's median wall time over the rounds, the median of its per-round ratio to naive (both
variants of a ratio are timed within one round) and its range, the same for the process CPU time (both threads'
work; less sensitive to being descheduled on a loaded machine), and the load averages before and after.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
OP_PATH = "gtpo_megatron/ops/logprobs.py"


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True, text=True).stdout


def _load_module(name: str, source: str, commit: str | None, folder: Path):
    """Exec ``source`` as module ``name``; its ``gtpo_megatron`` imports are loaded at ``commit`` first."""
    saved = {}
    for sibling in sorted(set(re.findall(r"^from (gtpo_megatron[\w.]*) import", source, re.M))):
        path = sibling.replace(".", "/") + ".py"
        text = _git("show", f"{commit}:{path}") if commit else (REPO / path).read_text()
        saved[sibling] = sys.modules.get(sibling)
        sys.modules[sibling] = _load_module(f"{name}__{sibling.replace('.', '_')}", text, commit, folder)
    file = folder / f"{name}.py"
    file.write_text(source)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    try:
        spec.loader.exec_module(module)
    finally:
        for sibling, previous in saved.items():
            if previous is None:
                sys.modules.pop(sibling, None)
            else:
                sys.modules[sibling] = previous
    return module


def _code_key(source: str) -> str:
    """The module's code without docstrings, comments or layout (commits that only reword or reformat share it)."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
        ):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


def versions(commits: list[str] | None, folder: Path) -> list[tuple[str, object]]:
    """``(label, op function)`` per distinct code version (oldest first) and the working tree.

    A commit whose op code equals the previous version's (:func:`_code_key`, siblings included) joins its label.
    """
    if not commits:
        commits = list(reversed(_git("log", "--follow", "--format=%h", "--", OP_PATH).split()))
    sources = [(sha, _git("show", f"{sha}:{OP_PATH}")) for sha in commits] + [(None, (REPO / OP_PATH).read_text())]
    out, last_key = [], None
    for sha, source in sources:
        siblings = re.findall(r"^from (gtpo_megatron[\w.]*) import", source, re.M)
        key = _code_key(source) + "".join(
            _code_key(
                _git("show", f"{sha}:{s.replace('.', '/')}.py")
                if sha
                else (REPO / s.replace(".", "/")).with_suffix(".py").read_text()
            )
            for s in siblings
        )
        label = sha or "worktree"
        if key == last_key:
            out[-1] = (f"{out[-1][0]}={label}", out[-1][1])
            continue
        module = _load_module(f"logprobs_{label}", source, sha, folder)
        out.append((label, module.vocab_parallel_logprobs_entropy))
        last_key = key
    return out


def _naive(logits, targets, grad_out, _chunk):
    logp = torch.log_softmax(logits.float(), dim=-1)
    logprobs = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        (logp.exp() * logp).sum(dim=-1)
    (logprobs * grad_out).sum().backward()


def _fused(op):
    def run(logits, targets, grad_out, chunk):
        logprobs, _ = op(logits, targets, chunk_size=chunk)
        (logprobs * grad_out).sum().backward()

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--commits", nargs="*", help="default: every commit that touched the op")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        variants = [("naive", _naive)] + [(label, _fused(op)) for label, op in versions(args.commits, Path(tmp))]
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(args.tokens, args.vocab, generator=gen).requires_grad_()
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=gen)
    grad_out = torch.randn(args.tokens, generator=gen)
    times: dict[str, list[float]] = {label: [] for label, _ in variants}
    cpu: dict[str, list[float]] = {label: [] for label, _ in variants}
    load_before = os.getloadavg()
    for round_ in range(args.rounds + 1):  # round 0 warms up and is dropped
        for label, fn in variants:
            logits.grad = None
            start, start_cpu = time.perf_counter(), time.process_time()
            fn(logits, targets, grad_out, args.chunk_size)
            if round_:
                times[label].append(time.perf_counter() - start)
                cpu[label].append(time.process_time() - start_cpu)
    load_after = os.getloadavg()
    print(f"N={args.tokens} V={args.vocab} fp32 chunk={args.chunk_size} threads={args.threads} rounds={args.rounds}")
    print(f"load average (1, 5, 15 min): before {load_before}, after {load_after}")
    width = max(len(label) for label, _ in variants) + 2
    print(
        f"{'variant':<{width}}{'wall median s':>14}{'wall ratio':>11}{'ratio range':>13}"
        f"{'CPU median s':>13}{'CPU ratio':>10}"
    )
    for label, _ in variants:
        ratios = [t / n for t, n in zip(times[label], times["naive"], strict=True)]
        cpu_ratios = [t / n for t, n in zip(cpu[label], cpu["naive"], strict=True)]
        print(
            f"{label:<{width}}{statistics.median(times[label]):>14.3f}{statistics.median(ratios):>11.3f}"
            f"{min(ratios):>7.2f}-{max(ratios):<5.2f}{statistics.median(cpu[label]):>13.3f}"
            f"{statistics.median(cpu_ratios):>10.3f}"
        )


if __name__ == "__main__":
    main()
