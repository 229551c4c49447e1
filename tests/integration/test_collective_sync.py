"""Two real vLLM engines (multiprocess, one CPU core each) updated by the collective weight path.

After every update, every engine's log-probs of fixed token sequences must equal those of transformers on the
weights the trainer exported (fp32 on both sides: 1e-4, the engine test's tolerance); the same check run before an
update (an engine that skipped it) must fail, so the check can fail. An update whose stream fails half-way leaves
both engines unusable. This process plays global rank 0 (the sender) and both engine leaders.
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from gtpo_megatron.builtin_models import resolve_model_path
from gtpo_megatron.parallel.weight_group import WeightGroupSpec, join_weight_group, open_weight_store
from gtpo_megatron.plan.engines import EnginePlacement, split_cores
from gtpo_megatron.rollout.engine import SamplingConfig
from gtpo_megatron.rollout.engine_guard import GuardedEngine
from gtpo_megatron.rollout.engine_settings import EngineSettings
from gtpo_megatron.rollout.push import CollectiveWeightSync
from gtpo_megatron.rollout.vllm_engine import VLLMEngine
from tests.integration.test_vllm_engine import TINY_ATOL, hf_logprobs, perturb

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # two multiprocess engine starts

PROMPTS, COMPLETIONS = [[1, 2, 3, 4], [500, 600, 700]], [[5, 6, 7, 8, 9], [11, 12, 13]]


def _engines(path: str) -> list[GuardedEngine]:
    split = split_cores(sorted(os.sched_getaffinity(0)), num_trainer_ranks=0, num_engines=2, engine_tp_size=1)
    engines = []
    for i in range(2):
        bind = split.engine_binding(i)
        engine = VLLMEngine(path, EngineSettings(dtype="float32", max_model_len=64, max_num_seqs=4, in_process=False),
                            environment={"VLLM_CPU_OMP_THREADS_BIND": bind})  # fmt: skip
        placement = EnginePlacement(index=i, num_engines=2, leader_rank=i, ranks=(i,), devices=())
        engines.append(GuardedEngine(engine, placement=placement, timeout_s=300))
    return engines


def _connect(engines: list[GuardedEngine]):
    store = open_weight_store("127.0.0.1", world_size=3, timeout_s=300)
    spec = WeightGroupSpec(host="127.0.0.1", port=store.port, world_size=3, backend="gloo", timeout_s=300)
    joining = [e.start_join(spec.as_dict(), worker_offset=i) for i, e in enumerate(engines)]
    group = join_weight_group(spec, rank=0, store=store)
    for engine, call in zip(engines, joining):
        engine.wait(call, breaks_weights=False)
    return group


def _gap(engine: GuardedEngine, hf_model) -> float:
    """Largest |engine - transformers| log-prob over the fixed sequences."""
    scores = engine.engine.score(PROMPTS, COMPLETIONS)
    return max(
        float((hf_logprobs(hf_model, p, c) - torch.tensor(s).double()).abs().max())
        for p, c, s in zip(PROMPTS, COMPLETIONS, scores)
    )


def test_every_engine_matches_the_export_after_every_collective_update():
    path = resolve_model_path("builtin:tiny-llama")
    original = load_file(f"{path}/model.safetensors")
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engines = _engines(path)
    try:
        group = _connect(engines)
        sender = CollectiveWeightSync(engine=engines[0], group=group, exporting=True, bucket_bytes=2**20,
                                      dtype=torch.float32)  # fmt: skip
        exported = original
        for update in range(2):
            exported = perturb(exported)
            hf_model.load_state_dict(exported, strict=False)
            assert min(_gap(e, hf_model) for e in engines) > 0.05  # skipping the update is detected
            other = engines[1].start_receive()  # engine 1's leader, concurrently with the sender
            metrics = sender.sync(lambda w=exported: iter(w.items()))
            per_worker = engines[1].wait(other)
            assert per_worker[0]["num_tensors"] == len(original) == metrics["sync/num_tensors"]
            for engine in engines:
                assert _gap(engine, hf_model) < TINY_ATOL, (update, engine.name)

        def broken():  # the trainer's gather fails after three tensors: the workers hold a half-new model
            yield from list(exported.items())[:3]
            raise RuntimeError("gather failed")

        other = engines[1].start_receive()
        with pytest.raises(RuntimeError, match=r"engine 0 of 2 \(leader rank 0.*weight update \(collective\) failed"):
            sender.sync(broken)
        with pytest.raises(RuntimeError, match=r"engine 1 of 2 \(leader rank 1"):
            engines[1].wait(other)
        for engine in engines:  # never used for generation again
            with pytest.raises(RuntimeError, match="is unusable since a weight update failed half-way"):
                engine.generate(PROMPTS, 1, SamplingConfig(seed=1))
    finally:
        for engine in engines:
            engine.close()
