"""``rollout.weight_sync: sharded`` end to end in one process: plan, join, one update into a vLLM worker extension.

A one-rank trainer (``world=None``) at TP 1 offers every piece; the engine is a stand-in whose one worker is the
real ``WeightReloadExtension`` with vLLM's ``reload_weights`` recording what it is fed. A sender failing half-way
must leave the engine unusable (no generation with a half-new model), naming the engine and the tensor.
"""

from __future__ import annotations

import pytest
import torch

from gtpo_megatron.megatron_adapter import hf_conversion as hc
from gtpo_megatron.megatron_adapter import hf_loading
from gtpo_megatron.megatron_adapter.shard_stream import shard_pieces
from gtpo_megatron.plan.engines import EnginePlacement
from gtpo_megatron.rollout.engine_guard import GuardedEngine
from gtpo_megatron.rollout.sharded_sync import connect_sharded_sync
from gtpo_megatron.rollout.vllm_worker import WeightReloadExtension
from tests.distributed.test_sharded_sync import _LAYER, PADDED, VOCAB, D, G, Q, _checkpoint

pytestmark = pytest.mark.distributed

NAMES = ["embedding.word_embeddings.weight", *(f"decoder.layers.{i}.{s}" for i in range(2) for s in _LAYER),
         "decoder.final_layernorm.weight", "output_layer.weight"]  # fmt: skip


class _Worker(WeightReloadExtension):
    """vLLM's side of one worker: ``reload_weights`` records the tensors (or fails after ``fail_after``)."""

    rank = 0

    def __init__(self) -> None:
        self.loaded, self.fail_after = {}, None

    def reload_weights(self, weights_iterator):
        for name, tensor in weights_iterator:
            if self.fail_after is not None and len(self.loaded) == self.fail_after:
                raise ValueError(f"vLLM could not load {name}")
            self.loaded[name] = tensor.clone()

    def _gtpo_repack_after_reload(self) -> None:
        pass


class _Engine:
    """The engine leader's side: each RPC runs on the one worker (``VLLMEngine``'s ``collective_rpc``)."""

    def __init__(self) -> None:
        self.worker = _Worker()

    def join_weight_group(self, spec, worker_offset):
        self.worker.gtpo_join_weight_group(spec, worker_offset)

    def receive_weights(self):
        return [self.worker.gtpo_receive_weights()]

    def generate(self, prompt_ids, n, sampling, prompt_indices=None):
        return []


def _pieces(folder, scale: list[float]):
    """The one rank's pieces; ``scale[0]`` multiplies the weights (a new step's weights)."""
    geometry = hc.ModelGeometry(num_heads=Q, num_query_groups=G, head_dim=D, vocab_size=VOCAB, padded_vocab_size=PADDED,
                                tie_word_embeddings=False, tp_size=1)  # fmt: skip
    reader = hf_loading.HFCheckpointReader(folder)
    named = [(n, hf_loading.shard_from_hf(hc.param_mapping(n, geometry), reader, geometry, 0)) for n in NAMES]
    return lambda: shard_pieces([(n, t * scale[0]) for n, t in named], geometry, tp_rank=0, tp_size=1, stage=0)


def test_one_rank_updates_an_engine_and_a_failed_update_leaves_it_unusable(tmp_path):
    original = _checkpoint(tmp_path)
    scale = [1.0]
    engine = _Engine()
    placement = EnginePlacement(index=0, num_engines=1, leader_rank=0, ranks=(0,), devices=())
    guarded = GuardedEngine(engine, placement=placement, timeout_s=10.0)
    sync = connect_sharded_sync(engine=guarded, pieces=_pieces(tmp_path, scale), rank=0, worker_offset=0, num_workers=1,
                                bucket_bytes=4096, dtype=torch.float32, timeout_s=5.0, world=None)  # fmt: skip
    for step in (1.0, 2.0):
        scale[0] = step
        metrics = sync.sync()
        assert engine.worker.loaded.keys() == original.keys()
        assert all(torch.equal(engine.worker.loaded[k], original[k] * step) for k in original)
    total = sum(t.numel() for t in original.values()) * 4
    assert metrics["sync/megabytes"] == total / 2**20 == metrics["sync/busiest_sender_megabytes"]
    assert metrics["sync/num_senders"] == 1 and metrics["time/sync_s"] >= metrics["sync/engine_pause_s"] > 0
    engine.worker.fail_after, engine.worker.loaded = 3, {}
    with pytest.raises(
        RuntimeError, match=r"engine 0 of 1 .*failed \(ValueError: vLLM could not load model\.layers\.0"
    ):
        sync.sync()
    with pytest.raises(RuntimeError, match="engine 0 of 1 .* is unusable since a weight update failed half-way"):
        guarded.generate([[1]], 1, None)


def test_a_rank_that_cannot_list_its_pieces_aborts_the_update(tmp_path):
    _checkpoint(tmp_path)
    engine = _Engine()
    placement = EnginePlacement(index=0, num_engines=1, leader_rank=0, ranks=(0,), devices=())
    guarded = GuardedEngine(engine, placement=placement, timeout_s=30.0)
    good = _pieces(tmp_path, [1.0])
    calls = []

    def pieces():
        calls.append(1)
        if len(calls) > 1:  # the plan at start-up lists them; the update's listing fails
            raise OSError("parameters unavailable")
        return good()

    sync = connect_sharded_sync(engine=guarded, pieces=pieces, rank=0, worker_offset=0, num_workers=1,
                                bucket_bytes=4096, dtype=torch.float32, timeout_s=20.0, world=None)  # fmt: skip
    # the abort's own message (not the silent-sender one the 20 s timeout would give): no wall time asserted
    with pytest.raises(RuntimeError, match=r"engine 0 of 1 .*sender 0 \(trainer rank 0; bucket 0: .*aborted the update "
                                           r"half-way: OSError\('parameters unavailable'\)"):  # fmt: skip
        sync.sync()
    with pytest.raises(RuntimeError, match="engine 0 of 1 .* is unusable since a weight update failed half-way"):
        guarded.generate([[1]], 1, None)
