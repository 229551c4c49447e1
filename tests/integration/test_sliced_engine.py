"""One real vLLM engine at TP 2 (two CPU workers) updated by the sliced sharded path, then by the collective path.

The trainer is TP=2 x PP=2 (four ranks as threads, shards of perturbed tiny-qwen2 weights, vocabulary padded so
that the last TP rank holds padding rows; ``test_sharded_sync._trainer``). Each engine worker receives only its
slice (``rollout/engine_slices.py``). After the sliced update the engine's log-probs equal transformers' on the
perturbed weights (before it they do not, so the check can fail); the collective update of the same weights then
leaves every parameter of both workers bit-identical (``torch.equal``) and the near-greedy generations unchanged.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from gtpo_megatron.builtin_models import resolve_model_path
from gtpo_megatron.parallel.weight_group import WeightGroupSpec, join_weight_group, open_weight_store
from gtpo_megatron.plan.engines import EnginePlacement
from gtpo_megatron.rollout.engine_guard import GuardedEngine
from gtpo_megatron.rollout.engine_settings import EngineSettings
from gtpo_megatron.rollout.engine_slices import EngineGeometry, tensor_slices
from gtpo_megatron.rollout.shard_plan import build_shard_plan
from gtpo_megatron.rollout.sharded_wire import send_shards
from gtpo_megatron.rollout.vllm_engine import VLLMEngine
from gtpo_megatron.rollout.weight_wire import send_weights
from tests.integration.test_collective_sync import _gap
from tests.integration.test_sharded_sync import _near_greedy, _trainer
from tests.integration.test_vllm_engine import TINY_ATOL, perturb

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # a two-worker engine start

ENGINE_TP = 2


def _engine(path: str) -> GuardedEngine:
    # vLLM's CPU workers bind threads per NUMA node; one node here, so each worker gets one core by hand.
    engine = VLLMEngine(path, EngineSettings(dtype="float32", max_model_len=64, max_num_seqs=4, in_process=False,
                                             tensor_parallel_size=ENGINE_TP),
                        environment={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})  # fmt: skip
    placement = EnginePlacement(index=0, num_engines=1, leader_rank=0, ranks=(0,), devices=())
    return GuardedEngine(engine, placement=placement, timeout_s=300)


def _group(engine: GuardedEngine, num_senders: int) -> list:
    """A weight group of the engine's two workers and ``num_senders`` senders (0: the collective path's one)."""
    senders = max(num_senders, 1)
    store = open_weight_store("127.0.0.1", world_size=senders + ENGINE_TP, timeout_s=300)
    spec = WeightGroupSpec(host="127.0.0.1", port=store.port, world_size=senders + ENGINE_TP, backend="gloo",
                           timeout_s=300, num_senders=num_senders)  # fmt: skip
    joining = engine.start_join(spec.as_dict(), worker_offset=0)
    with ThreadPoolExecutor(senders) as pool:
        members = [pool.submit(join_weight_group, spec, rank=r, store=store if r == 0 else None)
                   for r in range(senders)]  # fmt: skip
        members = [f.result() for f in members]
    engine.wait(joining, breaks_weights=False)
    return members


def _parameters(engine: GuardedEngine) -> list[dict[str, torch.Tensor]]:
    """Every worker's parameters (``WeightReloadExtension.gtpo_parameters``), bit for bit."""
    return [{name: _tensor(*value) for name, value in worker.items()}
            for worker in engine.engine._llm.collective_rpc("gtpo_parameters")]  # fmt: skip


def _tensor(dtype: str, shape: list[int], raw: bytes) -> torch.Tensor:
    if not raw:  # an empty parameter
        return torch.empty(shape, dtype=getattr(torch, dtype))
    return torch.frombuffer(bytearray(raw), dtype=getattr(torch, dtype)).reshape(shape)


def test_a_sliced_update_of_an_engine_at_tp_2_equals_the_collective_one(tmp_path):
    path = resolve_model_path("builtin:tiny-qwen2")
    save_file(perturb(load_file(f"{path}/model.safetensors")), str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(open(f"{path}/config.json").read())
    ranks, gathered = _trainer(str(tmp_path))
    geometry = EngineGeometry.from_hf(AutoConfig.from_pretrained(tmp_path), tp_size=ENGINE_TP)
    plan = build_shard_plan([offers for offers, _ in ranks], bucket_bytes=2**20, element_size=4,
                            engine_tp_size=ENGINE_TP, slicer=lambda n, s: tensor_slices(n, s, geometry))  # fmt: skip
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    engine = _engine(path)
    try:
        assert _gap(engine, hf_model) > 0.05  # not yet updated: the check can fail
        senders = _group(engine, len(plan.senders))
        receiving = engine.start_receive()
        with ThreadPoolExecutor(len(senders)) as pool:
            sends = [pool.submit(send_shards, plan, ranks[plan.senders[i]][1], group=g, num_workers=ENGINE_TP,
                                 dtype=torch.float32) for i, g in enumerate(senders)]  # fmt: skip
            stats = [f.result() for f in sends]
        workers = engine.wait(receiving)
        assert [w["num_tensors"] for w in workers] == [len(gathered)] * ENGINE_TP
        model_bytes = sum(t.numel() for _, t in gathered) * 4
        received = [w["num_bytes"] / model_bytes for w in workers]
        print(f"[sliced] each worker received {received} of the model; the senders packed "
              f"{sum(s.num_bytes for s in stats) / model_bytes:.3f} of it once")  # fmt: skip
        assert max(received) < 0.6  # about half each (norms whole), not the whole model
        assert _gap(engine, hf_model) < TINY_ATOL
        sliced, sliced_tokens = _parameters(engine), _near_greedy(engine)
        (sender,) = _group(engine, 0)
        receiving = engine.start_receive()
        send_weights(iter(gathered), group=sender, bucket_bytes=2**20, dtype=torch.float32)
        engine.wait(receiving)
        collective = _parameters(engine)
        for worker, (mine, theirs) in enumerate(zip(sliced, collective)):
            assert mine.keys() == theirs.keys()
            for name in mine:
                assert torch.equal(mine[name], theirs[name]), (worker, name)
        assert _near_greedy(engine) == sliced_tokens
    finally:
        engine.close()
