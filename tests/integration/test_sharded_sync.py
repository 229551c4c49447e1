"""Two real vLLM engines (multiprocess, engine TP 1): one updated by the collective path, one by the sharded path.

The trainer is TP=2 x PP=2 (four ranks as threads of this process, their shards from ``hf_loading.shard_from_hf``
of perturbed tiny-qwen2 weights, the vocabulary padded so that the last TP rank holds padding rows). After the
updates both engines' log-probs of fixed sequences equal transformers' on the perturbed weights (fp32, the engine
test's tolerance; before the update they do not, so the check can fail) and their near-greedy generations are the
same tokens.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from gtpo_megatron.builtin_models import resolve_model_path
from gtpo_megatron.megatron_adapter import hf_conversion as hc
from gtpo_megatron.megatron_adapter import hf_loading
from gtpo_megatron.megatron_adapter.shard_stream import shard_pieces
from gtpo_megatron.parallel.weight_group import WeightGroupSpec, join_weight_group, open_weight_store
from gtpo_megatron.plan.engines import EnginePlacement, split_cores
from gtpo_megatron.rollout.engine import SamplingConfig
from gtpo_megatron.rollout.engine_guard import GuardedEngine
from gtpo_megatron.rollout.engine_settings import EngineSettings
from gtpo_megatron.rollout.shard_plan import build_shard_plan
from gtpo_megatron.rollout.sharded_wire import send_shards
from gtpo_megatron.rollout.vllm_engine import VLLMEngine
from gtpo_megatron.rollout.weight_wire import send_weights
from tests.distributed.test_sharded_sync import STAGES
from tests.integration.test_collective_sync import PROMPTS, _gap
from tests.integration.test_vllm_engine import TINY_ATOL, perturb

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # two multiprocess engine starts

TP, PP, PADDED_VOCAB = 2, 2, 49160  # 49152 real rows: rank 1's last 8 rows are padding


def _engine(path: str, index: int) -> GuardedEngine:
    split = split_cores(sorted(os.sched_getaffinity(0)), num_trainer_ranks=0, num_engines=2, engine_tp_size=1)
    engine = VLLMEngine(path, EngineSettings(dtype="float32", max_model_len=64, max_num_seqs=4, in_process=False),
                        environment={"VLLM_CPU_OMP_THREADS_BIND": split.engine_binding(index)})  # fmt: skip
    placement = EnginePlacement(index=index, num_engines=1, leader_rank=0, ranks=(0,), devices=())
    return GuardedEngine(engine, placement=placement, timeout_s=300)


def _group(engine: GuardedEngine, num_senders: int) -> list:
    """The weight group of ``engine``'s one worker: the collective one (``num_senders`` 0) or a sharded one."""
    size = max(num_senders, 1) + 1
    store = open_weight_store("127.0.0.1", world_size=size, timeout_s=300)
    spec = WeightGroupSpec(host="127.0.0.1", port=store.port, world_size=size, backend="gloo", timeout_s=300,
                           num_senders=num_senders)  # fmt: skip
    joining = engine.start_join(spec.as_dict(), worker_offset=0)
    with ThreadPoolExecutor(max(num_senders, 1)) as pool:
        senders = [pool.submit(join_weight_group, spec, rank=r, store=store if r == 0 else None)
                   for r in range(max(num_senders, 1))]  # fmt: skip
        senders = [f.result() for f in senders]
    engine.wait(joining, breaks_weights=False)
    return senders


def _trainer(folder: str):
    geometry = hc.ModelGeometry.from_hf(AutoConfig.from_pretrained(folder), padded_vocab_size=PADDED_VOCAB, tp_size=TP)
    reader = hf_loading.HFCheckpointReader(folder)
    shard = hf_loading.shard_from_hf
    shards = {(pp, tp): [(n, shard(hc.param_mapping(n, geometry), reader, geometry, tp)) for n in names]
              for pp, names in enumerate(STAGES) for tp in range(TP)}  # fmt: skip
    ranks = [shard_pieces(shards[(pp, tp)], geometry, tp_rank=tp, tp_size=TP, stage=pp)
             for pp in range(PP) for tp in range(TP)]  # fmt: skip
    gathered = []  # what hf_stream.iter_hf_weights yields: every parameter's TP shards joined
    for pp, names in enumerate(STAGES):
        for i, name in enumerate(names):
            mapping = hc.param_mapping(name, geometry)
            gathered += hc.hf_from_shards(mapping, [shards[(pp, tp)][i][1] for tp in range(TP)], geometry)
    return ranks, gathered


def _near_greedy(engine: GuardedEngine) -> list[list[int]]:
    sampling = SamplingConfig(temperature=1e-3, max_tokens=12, seed=1, logprobs=False)
    return [c.token_ids for group in engine.generate(PROMPTS, 1, sampling) for c in group.completions]


def test_sharded_and_collective_updates_give_the_same_engine(tmp_path):
    path = resolve_model_path("builtin:tiny-qwen2")
    perturbed = perturb(load_file(f"{path}/model.safetensors"))
    save_file(perturbed, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(open(f"{path}/config.json").read())
    ranks, gathered = _trainer(str(tmp_path))
    plan = build_shard_plan([offers for offers, _ in ranks], bucket_bytes=2**20, element_size=4)
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    engines = [_engine(path, 0), _engine(path, 1)]
    try:
        (sender,) = _group(engines[0], 0)
        senders = _group(engines[1], len(plan.senders))
        assert min(_gap(e, hf_model) for e in engines) > 0.05  # not yet updated: the check can fail
        receiving = engines[0].start_receive()
        send_weights(iter(gathered), group=sender, bucket_bytes=2**20, dtype=torch.float32)
        engines[0].wait(receiving)
        receiving = engines[1].start_receive()
        with ThreadPoolExecutor(len(senders)) as pool:
            sends = [pool.submit(send_shards, plan, ranks[plan.senders[i]][1], group=g, num_workers=1,
                                 dtype=torch.float32) for i, g in enumerate(senders)]  # fmt: skip
            stats = [f.result() for f in sends]
        (worker,) = engines[1].wait(receiving)
        assert worker["num_tensors"] == len(gathered) == len(perturbed)
        assert sum(s.num_bytes for s in stats) == sum(t.numel() for t in perturbed.values()) * 4
        for engine in engines:
            assert _gap(engine, hf_model) < TINY_ATOL, engine.name
        assert _near_greedy(engines[0]) == _near_greedy(engines[1])
    finally:
        for engine in engines:
            engine.close()
