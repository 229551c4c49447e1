"""Benchmark: one weight update of a vLLM CPU engine, ``collective`` vs ``files`` (``rollout.weight_sync``), one run.

Usage: ``python benchmarks/bench_weight_sync.py [--model builtin:smollm2-135m-instruct] [--repeats 3]
[--bucket-mb 256]``

One multiprocess ``VLLMEngine`` (fp32, as the trainer's fp32 weights: 513 MB for SmolLM2-135M, so both paths move
the same bytes) receives the checkpoint's own tensors ``--repeats`` times by each path. The tensors are copied into
memory first, as the trainer's gather leaves them, and the process uses one torch thread, as a torchrun trainer
process does; the Megatron gather that produces the stream in training is the same for both paths and is left out.
Printed per path (median over repeats):

- ``files``: ``write`` (``load_weight_bucket``: cast, copy, safetensors shard into ``/dev/shm``) and ``reload``
  (``finish_weight_update``: the workers' ``reload_weights(weights_path=...)``, prefix-cache reset);
- ``collective``: ``total`` (the sender's ``send_weights`` until the engine's RPC returned), ``broadcast``
  (the sender's time waiting for its broadcasts), and on the worker ``waiting`` (its reload waiting for the next
  bucket to arrive) and ``reload`` (the rest of its ``reload_weights`` pass: vLLM's ``load_weights`` and
  ``process_weights_after_loading``, which re-packs the CPU GEMM weights).

The last line is the ratio files / collective of the totals. After both paths the engine's log-probs of a fixed
sequence must be the same (the same weights went in).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from safetensors.torch import load_file

from gtpo_megatron.builtin_models import resolve_model_path
from gtpo_megatron.parallel.weight_group import WeightGroupSpec, join_weight_group, open_weight_store
from gtpo_megatron.plan.engines import EnginePlacement
from gtpo_megatron.rollout.engine_guard import GuardedEngine
from gtpo_megatron.rollout.engine_settings import EngineSettings
from gtpo_megatron.rollout.push import iter_weight_buckets
from gtpo_megatron.rollout.vllm_engine import VLLMEngine
from gtpo_megatron.rollout.weight_wire import send_weights


def _files(engine: VLLMEngine, weights: dict, bucket_bytes: int) -> dict[str, float]:
    start = time.perf_counter()
    engine.begin_weight_update()
    for bucket in iter_weight_buckets(weights.items(), bucket_bytes=bucket_bytes):
        engine.load_weight_bucket(bucket)
    written = time.perf_counter()
    engine.finish_weight_update()
    end = time.perf_counter()
    return {"write": written - start, "reload": end - written, "total": end - start}


def _collective(guarded: GuardedEngine, group, weights: dict, bucket_bytes: int) -> dict[str, float]:
    start = time.perf_counter()
    receiving = guarded.start_receive()
    sent = send_weights(iter(weights.items()), group=group, bucket_bytes=bucket_bytes, dtype=torch.float32)
    (worker,) = guarded.wait(receiving)
    total = time.perf_counter() - start
    return {"total": total, "broadcast": sent.transfer_s, "waiting": worker["transfer_s"],
            "reload": worker["seconds"] - worker["transfer_s"]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as in a trainer process (torchrun sets OMP_NUM_THREADS=1)
    path = resolve_model_path(args.model)
    weights = {k: v.float().clone() for k, v in load_file(f"{path}/model.safetensors").items()}  # in RAM, as a gather
    megabytes = sum(t.numel() * 4 for t in weights.values()) / 1e6
    bucket_bytes = args.bucket_mb * 2**20
    engine = VLLMEngine(path, EngineSettings(dtype="float32", max_model_len=256, max_num_seqs=4, in_process=False))
    placement = EnginePlacement(index=0, num_engines=1, leader_rank=0, ranks=(0,), devices=())
    guarded = GuardedEngine(engine, placement=placement, timeout_s=600)
    try:
        store = open_weight_store("127.0.0.1", world_size=2, timeout_s=600)
        spec = WeightGroupSpec(host="127.0.0.1", port=store.port, world_size=2, backend="gloo", timeout_s=600)
        joining = guarded.start_join(spec.as_dict(), worker_offset=0)
        group = join_weight_group(spec, rank=0, store=store)
        guarded.wait(joining, breaks_weights=False)
        runs = {"files": [], "collective": []}
        for _ in range(args.repeats):
            runs["files"].append(_files(engine, weights, bucket_bytes))
            after_files = engine.score([[1, 2, 3]], [[4, 5, 6, 7]])
            runs["collective"].append(_collective(guarded, group, weights, bucket_bytes))
            assert engine.score([[1, 2, 3]], [[4, 5, 6, 7]]) == after_files, "the two paths loaded different weights"
    finally:
        engine.close()
    print(f"{args.model}: {megabytes:.0f} MB fp32, buckets of {args.bucket_mb} MiB, median of {args.repeats} (s)")
    for name, results in runs.items():
        cells = ", ".join(f"{k} {statistics.median(r[k] for r in results):.3f}" for k in results[0])
        print(f"  {name:<10} {cells}")
    files = statistics.median(r["total"] for r in runs["files"])
    collective = statistics.median(r["total"] for r in runs["collective"])
    print(f"files / collective = {files / collective:.2f}x ({megabytes / 1e3 / collective:.2f} GB/s collective)")


if __name__ == "__main__":
    main()
