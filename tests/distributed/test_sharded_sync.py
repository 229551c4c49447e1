"""The sharded weight sync over a real gloo weight group: trainer TP=2 x PP=2 x DP=2 -> 2 engine workers at TP 1.

Each training rank's shards come from ``hf_loading.shard_from_hf`` of a tiny literal checkpoint (head padding
3 -> 4 KV groups, padded vocabulary), so no Megatron model is needed; members are threads of this process (as
``test_weight_wire.py``). The collective path's tensors are ``hf_from_shards`` of all TP shards (what
``hf_stream.iter_hf_weights`` sends), cast to the engines' dtype: every worker must receive exactly those.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import save_file

from gtpo_megatron.megatron_adapter import hf_conversion as hc
from gtpo_megatron.megatron_adapter import hf_loading
from gtpo_megatron.megatron_adapter.shard_stream import shard_pieces
from gtpo_megatron.rollout.shard_plan import build_shard_plan
from gtpo_megatron.rollout.sharded_wire import receive_shards, send_shards
from tests.distributed.test_weight_wire import _groups

pytestmark = pytest.mark.distributed

Q, G, D, H, F, VOCAB, PADDED, TP, PP, DP = 6, 3, 4, 8, 12, 30, 32, 2, 2, 2
DTYPE = torch.bfloat16
FAILURE_TIMEOUT_S = 3.0
"""The weight group's timeout where a member stays silent: the others, nine threads of this process, must join and
send within it on a loaded machine (1 s did not always hold), so that only the silent member is named."""
_LAYER = ("input_layernorm.weight", "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
          "self_attention.linear_proj.weight", "pre_mlp_layernorm.weight", "mlp.linear_fc1.weight",
          "mlp.linear_fc2.weight")  # fmt: skip
STAGES = [
    ["embedding.word_embeddings.weight", *(f"decoder.layers.0.{s}" for s in _LAYER)],
    [*(f"decoder.layers.1.{s}" for s in _LAYER), "decoder.final_layernorm.weight", "output_layer.weight"],
]


def _checkpoint(folder) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    tensors = {"model.embed_tokens.weight": (VOCAB, H), "model.norm.weight": (H,), "lm_head.weight": (VOCAB, H)}
    for i in range(2):
        p = f"model.layers.{i}."
        tensors |= {p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                    p + "self_attn.q_proj.weight": (Q * D, H), p + "self_attn.k_proj.weight": (G * D, H),
                    p + "self_attn.v_proj.weight": (G * D, H), p + "self_attn.q_proj.bias": (Q * D,),
                    p + "self_attn.k_proj.bias": (G * D,), p + "self_attn.v_proj.bias": (G * D,),
                    p + "self_attn.o_proj.weight": (H, Q * D), p + "mlp.gate_proj.weight": (F, H),
                    p + "mlp.up_proj.weight": (F, H), p + "mlp.down_proj.weight": (H, F)}  # fmt: skip
    tensors = {name: torch.randn(shape, generator=gen) for name, shape in tensors.items()}
    save_file(tensors, str(folder / "model.safetensors"))
    return tensors


def _trainer(folder):
    """Per global rank (DP-major: ``rank = (dp * PP + pp) * TP + tp``): ``(offers, pieces)``; and the geometry."""
    geometry = hc.ModelGeometry(num_heads=Q, num_query_groups=G, head_dim=D, vocab_size=VOCAB, padded_vocab_size=PADDED,
                                tie_word_embeddings=False, tp_size=TP, num_pad_groups=1)  # fmt: skip
    reader = hf_loading.HFCheckpointReader(folder)
    ranks = []
    for _dp in range(DP):
        for pp in range(PP):
            for tp in range(TP):
                named = [
                    (n, hf_loading.shard_from_hf(hc.param_mapping(n, geometry), reader, geometry, tp))
                    for n in STAGES[pp]
                ]
                ranks.append(shard_pieces(named, geometry, tp_rank=tp, tp_size=TP, stage=pp))
    return ranks, geometry, reader


def _collective_reference(geometry, reader) -> dict[str, torch.Tensor]:
    """What the collective path sends: each parameter's TP shards joined by ``hf_from_shards``, cast."""
    out = {}
    for name in [n for stage in STAGES for n in stage]:
        mapping = hc.param_mapping(name, geometry)
        shards = [hf_loading.shard_from_hf(mapping, reader, geometry, r) for r in range(TP)]
        out |= {n: t.to(DTYPE) for n, t in hc.hf_from_shards(mapping, shards, geometry)}
    return out


def _run(plan, ranks, timeout_s=10.0, pieces_of=None):
    """Every sender and 2 workers at once; returns ``(sender results, worker results)`` as futures' outcomes."""
    num_senders = len(plan.senders)
    members = _groups(num_senders + 2, timeout_s=timeout_s)
    pieces_of = pieces_of or (lambda i: ranks[plan.senders[i]][1])
    with ThreadPoolExecutor(num_senders + 2) as pool:
        workers = [
            pool.submit(lambda g=g: [(n, t.clone()) for n, t in receive_shards(g)]) for g in members[num_senders:]
        ]
        senders = [pool.submit(send_shards, plan, pieces_of(i), group=members[i], num_workers=2, dtype=DTYPE)
                   for i in range(num_senders)]  # fmt: skip
        return [_outcome(f) for f in senders], [_outcome(f) for f in workers]


def _outcome(future):
    try:
        return future.result()
    except Exception as err:  # noqa: BLE001 - the tests look at each member's error
        return err


def test_workers_receive_exactly_the_collective_paths_tensors(tmp_path):
    original = _checkpoint(tmp_path)
    ranks, geometry, reader = _trainer(tmp_path)
    plan = build_shard_plan([offers for offers, _ in ranks], bucket_bytes=2048, element_size=2)
    reference = _collective_reference(geometry, reader)
    assert reference.keys() == original.keys()
    assert all(torch.equal(reference[k], original[k].to(DTYPE)) for k in original)
    assert len(plan.buckets) > 3 and len(plan.senders) == TP * PP * DP  # the DP replicas send too
    senders, workers = _run(plan, ranks)
    for stats in senders:
        assert not isinstance(stats, Exception), stats
    for received in workers:
        assert not isinstance(received, Exception), received
        assert [n for n, _ in received] == [t.name for t in plan.tensors] and len(received) == len(reference)
        for name, tensor in received:
            assert tensor.dtype == DTYPE and torch.equal(tensor, reference[name]), name
    total = sum(t.numel() for t in reference.values())
    busiest = max(plan.sender_elements())
    print(f"[sharded] {len(plan.senders)} senders, busiest sends {busiest / total:.3f} of the model to each worker")
    assert sum(plan.sender_elements()) == total and busiest < total / 4


def test_a_layout_that_leaves_a_slice_unsent_is_refused(tmp_path):
    _checkpoint(tmp_path)
    ranks, _, _ = _trainer(tmp_path)
    offers = [[o for o in rank_offers if not (o.name == "model.layers.1.mlp.up_proj.weight" and o.part == 1)]
              for rank_offers, _ in ranks]  # fmt: skip
    with pytest.raises(ValueError, match=r"no training rank holds parts \[1\] of 'model.layers.1.mlp.up_proj.weight'"):
        build_shard_plan(offers, bucket_bytes=2048, element_size=2)


class _Failing(dict):
    """A sender's pieces whose copy of one tensor raises (a cast or copy failing half-way)."""

    def __init__(self, pieces, bad: str) -> None:
        super().__init__(pieces)
        self.bad = bad

    def __getitem__(self, key):
        if key[0] == self.bad:
            raise MemoryError(f"injected failure copying {key[0]}")
        return super().__getitem__(key)


def test_a_sender_failing_mid_sync_fails_the_workers_naming_it(tmp_path):
    _checkpoint(tmp_path)
    ranks, _, _ = _trainer(tmp_path)
    plan = build_shard_plan([offers for offers, _ in ranks], bucket_bytes=2048, element_size=2)
    bad = plan.tensors[-1]  # the last bucket: the senders have sent earlier buckets
    failing = bad.parts[0][0]
    start = time.perf_counter()
    senders, workers = _run(plan, ranks, timeout_s=3.0,
                            pieces_of=lambda i: _Failing(ranks[plan.senders[i]][1], bad.name) if i == failing
                            else ranks[plan.senders[i]][1])  # fmt: skip
    elapsed = time.perf_counter() - start
    assert isinstance(senders[failing], MemoryError)
    rank = plan.senders[failing]
    for error in workers:
        assert isinstance(error, RuntimeError)
        assert f"sender {failing} (trainer rank {rank}; bucket {len(plan.buckets) - 1}: " in str(error)
        assert bad.name in str(error) and "aborted the update half-way" in str(error) and "injected" in str(error)
    print(f"[sharded] a failing sender ends the sync after {elapsed:.2f} s (timeout 3 s)")
    assert elapsed < 30  # bounded: the abort arrives at once, the other senders fail within the timeout


def test_a_silent_sender_fails_the_workers_within_the_timeout(tmp_path):
    _checkpoint(tmp_path)
    ranks, _, _ = _trainer(tmp_path)
    plan = build_shard_plan([offers for offers, _ in ranks], bucket_bytes=1 << 20, element_size=2)
    num_senders = len(plan.senders)
    members = _groups(num_senders + 1, timeout_s=FAILURE_TIMEOUT_S)
    with ThreadPoolExecutor(num_senders) as pool:
        worker = pool.submit(lambda: list(receive_shards(members[-1])))
        for i in range(num_senders - 1):  # the last sender never sends
            pool.submit(send_shards, plan, ranks[plan.senders[i]][1], group=members[i], num_workers=1, dtype=DTYPE)
        error = _outcome(worker)
    assert isinstance(error, RuntimeError)
    assert f"nothing from sender {num_senders - 1} (trainer rank {plan.senders[-1]}; bucket 0: " in str(error)


def test_a_worker_that_takes_nothing_fails_the_senders_naming_it(tmp_path):
    """An engine worker that died after joining: every sender's send to it fails within the timeout, naming it."""
    _checkpoint(tmp_path)
    ranks, _, _ = _trainer(tmp_path)
    plan = build_shard_plan([offers for offers, _ in ranks], bucket_bytes=1 << 20, element_size=2)
    num_senders = len(plan.senders)
    members = _groups(num_senders + 1, timeout_s=FAILURE_TIMEOUT_S)
    with ThreadPoolExecutor(num_senders) as pool:
        sends = [pool.submit(send_shards, plan, ranks[plan.senders[i]][1], group=members[i], num_workers=1,
                             dtype=DTYPE) for i in range(num_senders)]  # fmt: skip
        errors = [_outcome(f) for f in sends]
    assert all(isinstance(e, RuntimeError) for e in errors), errors
    assert f"sender 1 (trainer rank {plan.senders[1]}) could not deliver bucket 0 (" in str(errors[1])
    within = f"within {FAILURE_TIMEOUT_S:g} s"
    assert f"to engine worker 0 {within}" in str(errors[1])
    assert f"sender 0 (trainer rank 0) could not deliver the plan to engine worker 0 {within}" in str(errors[0])
