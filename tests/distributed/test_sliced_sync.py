"""The sharded sync to engines at TP > 1 over a real gloo weight group: each worker receives only its slice.

Trainer TP=2 x PP=2 (shards from ``hf_loading.shard_from_hf`` of a tiny literal checkpoint, the trainer's padded
vocabulary rows on its last TP rank) -> 2 engines at TP 2 or TP 4 (4 KV heads... 2 KV heads on 4 ranks: replicated;
vocabulary 70 padded by vLLM to 128: at TP 4 the last rank holds padding only). Every worker's tensor must hold,
at its slice (``engine_slices.engine_slice``), exactly the collective path's tensor (cast to the engines' dtype);
``tests/rollout/test_engine_slices.py`` shows vLLM's loaders read nothing else.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import save_file

from gtpo_megatron.megatron_adapter import hf_conversion as hc
from gtpo_megatron.megatron_adapter import hf_loading
from gtpo_megatron.megatron_adapter.shard_stream import shard_pieces
from gtpo_megatron.rollout.engine_slices import EngineGeometry, engine_slice, tensor_slices
from gtpo_megatron.rollout.shard_plan import build_shard_plan
from gtpo_megatron.rollout.sharded_wire import receive_shards, send_shards
from tests.distributed.test_sharded_sync import STAGES
from tests.distributed.test_weight_wire import _groups

pytestmark = pytest.mark.distributed

Q, G, D, H, F, VOCAB, PADDED, TP, PP, NUM_ENGINES = 4, 2, 4, 8, 12, 70, 72, 2, 2, 2
DTYPE = torch.bfloat16


def _checkpoint(folder) -> None:
    gen = torch.Generator().manual_seed(1)
    shapes = {"model.embed_tokens.weight": (VOCAB, H), "model.norm.weight": (H,), "lm_head.weight": (VOCAB, H)}
    for i in range(2):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                   p + "self_attn.q_proj.weight": (Q * D, H), p + "self_attn.k_proj.weight": (G * D, H),
                   p + "self_attn.v_proj.weight": (G * D, H), p + "self_attn.q_proj.bias": (Q * D,),
                   p + "self_attn.k_proj.bias": (G * D,), p + "self_attn.v_proj.bias": (G * D,),
                   p + "self_attn.o_proj.weight": (H, Q * D), p + "mlp.gate_proj.weight": (F, H),
                   p + "mlp.up_proj.weight": (F, H), p + "mlp.down_proj.weight": (H, F)}  # fmt: skip
    save_file(
        {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}, str(folder / "model.safetensors")
    )


def _trainer(folder):
    """``(offers, pieces)`` of each trainer rank (``rank = pp * TP + tp``) and the collective path's tensors."""
    geometry = hc.ModelGeometry(num_heads=Q, num_query_groups=G, head_dim=D, vocab_size=VOCAB, padded_vocab_size=PADDED,
                                tie_word_embeddings=False, tp_size=TP)  # fmt: skip
    reader = hf_loading.HFCheckpointReader(folder)
    shards = {(pp, tp): [(n, hf_loading.shard_from_hf(hc.param_mapping(n, geometry), reader, geometry, tp))
                         for n in STAGES[pp]] for pp in range(PP) for tp in range(TP)}  # fmt: skip
    ranks = [shard_pieces(shards[(pp, tp)], geometry, tp_rank=tp, tp_size=TP, stage=pp)
             for pp in range(PP) for tp in range(TP)]  # fmt: skip
    reference = {}
    for pp, names in enumerate(STAGES):
        for i, name in enumerate(names):
            joined = hc.hf_from_shards(hc.param_mapping(name, geometry), [shards[(pp, tp)][i][1] for tp in range(TP)],
                                       geometry)  # fmt: skip
            reference |= {n: t.to(DTYPE) for n, t in joined}
    return ranks, reference


def _run(plan, ranks, num_workers: int):
    num_senders = len(plan.senders)
    members = _groups(num_senders + num_workers)
    with ThreadPoolExecutor(num_senders + num_workers) as pool:
        workers = [pool.submit(lambda g=g: [(n, t.clone()) for n, t in receive_shards(g)])
                   for g in members[num_senders:]]  # fmt: skip
        senders = [pool.submit(send_shards, plan, ranks[plan.senders[i]][1], group=members[i],
                               num_workers=num_workers, dtype=DTYPE) for i in range(num_senders)]  # fmt: skip
        return [f.result() for f in senders], [f.result() for f in workers]


@pytest.mark.parametrize("engine_tp_size", [2, 4])
def test_each_worker_receives_its_slice_of_the_collective_paths_tensors(tmp_path, engine_tp_size):
    _checkpoint(tmp_path)
    ranks, reference = _trainer(tmp_path)
    engines = EngineGeometry(tp_size=engine_tp_size, num_heads=Q, num_kv_heads=G, head_dim=D, vocab_size=VOCAB)
    plan = build_shard_plan([offers for offers, _ in ranks], bucket_bytes=2048, element_size=2,
                            engine_tp_size=engine_tp_size,
                            slicer=lambda name, shape: tensor_slices(name, shape, engines))  # fmt: skip
    whole = build_shard_plan([offers for offers, _ in ranks], bucket_bytes=2048, element_size=2)
    senders, workers = _run(plan, ranks, NUM_ENGINES * engine_tp_size)
    for worker, received in enumerate(workers):
        rank = worker % engine_tp_size
        assert [n for n, _ in received] == [t.name for t in plan.tensors] and len(received) == len(reference)
        for name, tensor in received:
            assert tensor.shape == reference[name].shape and tensor.dtype == DTYPE, name
            where = engine_slice(name, tuple(tensor.shape), engines, rank)
            if where is None:
                assert torch.equal(tensor, reference[name]), (worker, name)
                continue
            length = where.stop - where.start
            got, want = (t.narrow(where.dim, where.start, length) for t in (tensor, reference[name]))
            assert torch.equal(got, want), (worker, name)
    sent = sum(s.num_bytes for s in senders) // 2  # elements packed once per engine TP rank
    assert sent * NUM_ENGINES == sum(plan.sender_elements(NUM_ENGINES))
    busiest, unsliced = max(plan.sender_elements(NUM_ENGINES)), max(whole.sender_elements(NUM_ENGINES * engine_tp_size))
    print(f"[sliced] engine TP {engine_tp_size}: the busiest sender sends {busiest / unsliced:.3f} of the unsliced")
    assert busiest < unsliced / (engine_tp_size / 2)  # about 1/engine_tp_size; whole norms and replicated KV heads


def test_a_split_the_engines_cannot_take_is_refused():
    engines = EngineGeometry(tp_size=3, num_heads=Q, num_kv_heads=G, head_dim=D, vocab_size=VOCAB)
    with pytest.raises(ValueError, match=r"model.embed_tokens.weight: 128 does not split into 3 equal parts"):
        tensor_slices("model.embed_tokens.weight", (VOCAB, H), engines)
