"""Benchmark: one weight update by ``collective``, ``sharded`` (engines at TP 1) and ``sliced``, in one run.

Usage: ``python benchmarks/bench_sharded_sync.py [--model builtin:smollm2-135m-instruct] [--tp 2] [--pp 2]
[--workers 3] [--engine-tp 3] [--repeats 3] [--bucket-mb 64]``

A trainer of ``tp * pp`` ranks (threads; shards from ``hf_loading.shard_from_hf``, SmolLM2's 3 KV groups
padded to 4 at TP 2) updates ``--workers`` engine workers (threads that take each tensor off the wire and drop it:
no vLLM, so the wire and the joins are what is timed) over one gloo weight group on loopback, bfloat16. Collective:
every parameter's TP shards joined as ``hf_stream`` does (the gather's communication is left out, as the
collective benchmark does), then rank 0 broadcasts; sharded: every rank sends its own parts at once, each worker
the whole model (engines at TP 1); sliced: the same workers as engines at ``--engine-tp``, each receiving only its
slice (``rollout/engine_slices.py``; SmolLM2's 9 heads split 3 ways, not 2). Printed per path (median over
repeats): the bytes the busiest sender hands to the wire (collective: one broadcast payload of the model, gloo's
algorithm fans it out; sharded and sliced: the plan's parts for every worker), the seconds until every worker has
every tensor, and the ratios to the collective time. On a shared 2-core machine the threads compete for the same
cores: the ratio says little about a cluster's links (``gtpo-plan`` models those).
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from transformers import AutoConfig

from gtpo_megatron.builtin_models import resolve_model_path
from gtpo_megatron.megatron_adapter import hf_conversion as hc
from gtpo_megatron.megatron_adapter import hf_loading
from gtpo_megatron.megatron_adapter.shard_stream import shard_pieces
from gtpo_megatron.parallel.weight_group import WeightGroupSpec, join_weight_group, open_weight_store
from gtpo_megatron.rollout.engine_slices import EngineGeometry, tensor_slices
from gtpo_megatron.rollout.shard_plan import build_shard_plan
from gtpo_megatron.rollout.sharded_wire import receive_shards, send_shards
from gtpo_megatron.rollout.weight_wire import receive_weights, send_weights

DTYPE = torch.bfloat16
_LAYER = ("input_layernorm.weight", "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
          "self_attention.linear_proj.weight", "pre_mlp_layernorm.weight", "mlp.linear_fc1.weight",
          "mlp.linear_fc2.weight")  # fmt: skip


def _stages(reader, geometry, num_layers: int, pp: int) -> list[list[str]]:
    """Megatron names per stage (layers split evenly), the ones the checkpoint has a mapping for."""
    per = num_layers // pp
    stages = [[f"decoder.layers.{i}.{s}" for i in range(p * per, (p + 1) * per) for s in _LAYER] for p in range(pp)]
    stages[0].insert(0, "embedding.word_embeddings.weight")
    stages[-1] += ["decoder.final_layernorm.weight", "output_layer.weight"]
    keep = lambda n: all(h in reader for h in hc.param_mapping(n, geometry).hf_names)  # noqa: E731
    return [[n for n in names if keep(n) and hc.param_mapping(n, geometry).exported] for names in stages]


def _trainer(path: str, tp: int, pp: int):
    config = AutoConfig.from_pretrained(path)
    print(f"{path}: {config.num_attention_heads} heads, {config.num_key_value_heads} KV heads")
    padded = -(-config.vocab_size // (128 * tp)) * 128 * tp
    geometry = hc.ModelGeometry.from_hf(config, padded_vocab_size=padded, tp_size=tp, pad_attention_heads=True)
    reader = hf_loading.HFCheckpointReader(path)
    stages = _stages(reader, geometry, config.num_hidden_layers, pp)
    shards = {(p, r): [(n, hf_loading.shard_from_hf(hc.param_mapping(n, geometry), reader, geometry, r)) for n in names]
              for p, names in enumerate(stages) for r in range(tp)}  # fmt: skip
    ranks = [
        shard_pieces(shards[(p, r)], geometry, tp_rank=r, tp_size=tp, stage=p) for p in range(pp) for r in range(tp)
    ]
    gathered = [t for p, names in enumerate(stages) for i, n in enumerate(names)
                for t in hc.hf_from_shards(hc.param_mapping(n, geometry), [shards[(p, r)][i][1] for r in range(tp)],
                                           geometry)]  # fmt: skip
    return ranks, gathered


def _groups(size: int, num_senders: int) -> list:
    store = open_weight_store("127.0.0.1", world_size=size, timeout_s=600)
    spec = WeightGroupSpec(host="127.0.0.1", port=store.port, world_size=size, backend="gloo", timeout_s=600,
                           num_senders=num_senders)  # fmt: skip
    with ThreadPoolExecutor(size) as pool:
        futures = [pool.submit(join_weight_group, spec, rank=r, store=store if r == 0 else None) for r in range(size)]
        return [f.result() for f in futures]


def _count(stream) -> int:
    return sum(1 for _ in stream)


def _collective(members, gathered, bucket_bytes: int) -> tuple[float, int]:
    start = time.perf_counter()
    with ThreadPoolExecutor(len(members)) as pool:
        workers = [pool.submit(_count, receive_weights(g)) for g in members[1:]]
        stats = send_weights(iter(gathered), group=members[0], bucket_bytes=bucket_bytes, dtype=DTYPE)
        assert all(w.result() == len(gathered) for w in workers)
    return time.perf_counter() - start, stats.num_bytes


def _sharded(members, plan, ranks, num_workers: int) -> tuple[float, int]:
    senders, engines = len(plan.senders), num_workers // plan.engine_tp_size
    start = time.perf_counter()
    with ThreadPoolExecutor(len(members)) as pool:
        workers = [pool.submit(_count, receive_shards(g)) for g in members[senders:]]
        sends = [pool.submit(send_shards, plan, ranks[plan.senders[i]][1], group=members[i], num_workers=num_workers,
                             dtype=DTYPE) for i in range(senders)]  # fmt: skip
        assert all(f.result() for f in sends) and all(w.result() == len(plan.tensors) for w in workers)
    busiest = max(plan.sender_elements(engines)) * DTYPE.itemsize
    return time.perf_counter() - start, busiest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--engine-tp", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=64)
    args = parser.parse_args()
    ranks, gathered = _trainer(resolve_model_path(args.model), args.tp, args.pp)
    bucket_bytes = args.bucket_mb * 2**20
    offers = [offers for offers, _ in ranks]
    plan = build_shard_plan(offers, bucket_bytes=bucket_bytes, element_size=2)
    engines = EngineGeometry.from_hf(AutoConfig.from_pretrained(resolve_model_path(args.model)), tp_size=args.engine_tp)
    sliced = build_shard_plan(offers, bucket_bytes=bucket_bytes, element_size=2, engine_tp_size=args.engine_tp,
                              slicer=lambda name, shape: tensor_slices(name, shape, engines))  # fmt: skip
    collective_group = _groups(1 + args.workers, 0)
    sharded_group = _groups(len(plan.senders) + args.workers, len(plan.senders))
    runs = {"collective": [], "sharded": [], "sliced": []}
    for _ in range(args.repeats):  # interleaved, so that a busy moment of the shared machine hits all three
        runs["collective"].append(_collective(collective_group, gathered, bucket_bytes))
        runs["sharded"].append(_sharded(sharded_group, plan, ranks, args.workers))
        runs["sliced"].append(_sharded(sharded_group, sliced, ranks, args.workers))
    model_mb = sum(t.numel() for _, t in gathered) * 2 / 1e6
    print(
        f"{args.model}: {model_mb:.0f} MB (bfloat16), trainer TP {args.tp} x PP {args.pp}, {args.workers} workers, "
        f"{len(plan.senders)} sharded senders, sliced: engines at TP {args.engine_tp}, buckets {args.bucket_mb} MiB"
    )
    seconds = {}
    for name, results in runs.items():
        seconds[name] = statistics.median(s for s, _ in results)
        busiest = results[0][1] / 1e6
        print(f"{name:>10}: busiest sender {busiest:.0f} MB to the wire, sync {seconds[name]:.3f} s (median)")
    for name in ("sharded", "sliced"):
        print(f"collective / {name} sync time: {seconds['collective'] / seconds[name]:.2f}")


if __name__ == "__main__":
    main()
