"""Memory estimates against values computed by hand, written out step by step, for a tiny and a 70B model."""

from __future__ import annotations

import dataclasses

import pytest

from gtpo_megatron.plan.architectures import KNOWN_ARCHITECTURES, Architecture
from gtpo_megatron.plan.memory import (
    TrainingShape,
    activation_bytes,
    engine_weight_bytes,
    estimate_stage,
    kv_cache_bytes_per_token,
    layer_activation_bytes,
    logits_bytes,
    logprob_working_set_bytes,
    stage_params,
    weight_sync_seconds,
)

# tiny-qwen2 dimensions: 2 layers, h 128, f 256, 4 heads, 2 KV heads, head_dim 32, vocab 49152, untied, qkv bias.
TINY = Architecture(
    name="tiny", num_layers=2, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4, num_query_groups=2,
    head_dim=32, vocab_size=49152, tied_embeddings=False, qkv_bias=True,
)  # fmt: skip
TINY_SHAPE = TrainingShape(
    tp_size=2, pp_size=1, dp_size=1, micro_batch_size=2, seq_length=64, num_microbatches=4, param_bytes=2,
    sequence_parallel=True, distributed_optimizer=False, recompute="none", logprob_chunk_size=None,
)  # fmt: skip
LLAMA70B = KNOWN_ARCHITECTURES["Llama-3.1-70B-Instruct"]
# 64 GPUs: tp 8 x pp 4 x dp 2, one 2048-token sequence per micro-batch, 32 micro-batches per step.
LLAMA_SHAPE = TrainingShape(
    tp_size=8, pp_size=4, dp_size=2, micro_batch_size=1, seq_length=2048, num_microbatches=32, param_bytes=2,
    sequence_parallel=True, distributed_optimizer=True, recompute="full", logprob_chunk_size=4096,
)  # fmt: skip
LLAMA_PADDED_VOCAB = 129024  # 128256 rounded up to a multiple of 128 * 8 = 1024: 126 * 1024


def test_tiny_stage_by_hand() -> None:
    # per layer 147,968 params, 256 of them RMSNorm weights (replicated): (147,968 - 256) / 2 + 256 = 74,112
    # 2 layers 148,224 + embedding 49152*128/2 = 3,145,728 + final norm 128 + output layer 3,145,728
    params = 148_224 + 3_145_728 + 128 + 3_145_728
    assert params == 6_439_808
    memory = estimate_stage(TINY, TINY_SHAPE, padded_vocab_size=49152, stage=0)
    assert memory.params == params
    assert memory.weights == 2 * params
    assert memory.grads == 4 * params
    assert memory.optimizer == 12 * params  # fp32 master + m + v, not sharded
    # per layer, sb = 2*64 = 128 tokens: 4h = 512 and 2q + 2k + 3f = 256 + 128 + 768 = 1152 elements per token,
    # bf16, all divided by tp=2 under sequence parallelism: 2 * 128 * 1664 / 2 = 212,992 bytes; 2 layers, 1 in flight
    assert layer_activation_bytes(TINY, TINY_SHAPE) == 212_992
    assert memory.activations == 2 * 212_992
    # logits [128 tokens, 24576 columns]: bf16 logits + bf16 grad = 2*2*128*24576 = 12,582,912;
    # two fp32 buffers 8 * 128 * 24576 = 25,165,824
    assert memory.logits == 12_582_912 + 25_165_824
    chunked = estimate_stage(TINY, dataclasses.replace(TINY_SHAPE, logprob_chunk_size=16), padded_vocab_size=49152,
                             stage=0)  # fmt: skip
    assert chunked.logits == 12_582_912 + 8 * 16 * 24576
    assert memory.total == memory.static + memory.activations + memory.logits


def test_tiny_without_sequence_parallel_keeps_norm_terms_whole() -> None:
    shape = dataclasses.replace(TINY_SHAPE, sequence_parallel=False)
    # 2 * 128 * (512 + 1152 / 2) = 278,528
    assert layer_activation_bytes(TINY, shape) == 278_528


def test_tiny_tied_embeddings_stored_once_without_pp_and_twice_with_pp() -> None:
    tied = dataclasses.replace(TINY, tied_embeddings=True)
    assert stage_params(tied, tp_size=1, pp_size=1, padded_vocab_size=49152, stage=0) == (
        tied.total_params()
    )  # one process holds the whole model exactly once
    # pp=2: stage 0 = 1 layer + embedding, stage 1 = 1 layer + final norm + a copy of the embedding
    assert stage_params(tied, tp_size=1, pp_size=2, padded_vocab_size=49152, stage=0) == 147_968 + 6_291_456
    assert stage_params(tied, tp_size=1, pp_size=2, padded_vocab_size=49152, stage=1) == 147_968 + 128 + 6_291_456


def test_llama70b_first_and_last_stage_by_hand() -> None:
    # per layer: 16,384 norm weights replicated, (855,654,400 - 16,384) / 8 = 106,954,752 sharded -> 106,971,136
    layers = 20 * 106_971_136  # 80 layers / pp 4
    embedding = 129024 * 8192 // 8  # 132,120,576
    first = estimate_stage(LLAMA70B, LLAMA_SHAPE, padded_vocab_size=LLAMA_PADDED_VOCAB, stage=0)
    last = estimate_stage(LLAMA70B, LLAMA_SHAPE, padded_vocab_size=LLAMA_PADDED_VOCAB, stage=3)
    assert first.params == layers + embedding == 2_271_543_296
    assert last.params == layers + 8192 + embedding == 2_271_551_488
    assert first.weights == 4_543_086_592
    assert first.grads == 9_086_173_184
    assert first.optimizer == 12 * 2_271_543_296 // 2 == 13_629_259_776  # distributed optimizer over dp=2
    # full recompute, SP: layer input 2 * 2048 * 8192 / 8 = 4,194,304 bytes per layer per micro-batch;
    # one whole layer while recomputing: 2 * 2048 * (4*8192 + 2*8192 + 2*1024 + 3*28672) / 8 = 70,254,592
    assert first.activations == 4 * 20 * 4_194_304 + 70_254_592  # stage 0 holds pp = 4 micro-batches
    assert last.activations == 1 * 20 * 4_194_304 + 70_254_592
    assert first.logits == 0
    # 2048 tokens x 16,128 columns: bf16 logits + grad 132,120,576; two fp32 buffers of min(4096, 2048) rows:
    # 8 * 2048 * 16128 = 264,241,152
    assert last.logits == 132_120_576 + 264_241_152
    assert first.static == (2 + 4 + 12 // 2) * 2_271_543_296  # Megatron's 6 + 12/dp bytes per parameter


def test_activation_in_flight_is_capped_by_microbatches() -> None:
    few = dataclasses.replace(LLAMA_SHAPE, num_microbatches=2)
    assert activation_bytes(LLAMA70B, few, stage=0) == 2 * 20 * 4_194_304 + 70_254_592


def test_selective_recompute_keeps_what_no_recompute_keeps() -> None:
    none = dataclasses.replace(LLAMA_SHAPE, recompute="none")
    selective = dataclasses.replace(LLAMA_SHAPE, recompute="selective")
    assert activation_bytes(LLAMA70B, selective, stage=0) == activation_bytes(LLAMA70B, none, stage=0)
    assert activation_bytes(LLAMA70B, none, stage=0) == 4 * 20 * 70_254_592


def test_kv_cache_engine_weights_and_sync_time() -> None:
    # K and V, 80 layers, 8 KV heads / engine tp 8 = 1 head, head_dim 128, bf16 -> 40,960 bytes per token per GPU
    assert kv_cache_bytes_per_token(LLAMA70B, engine_tp_size=8, kv_bytes=2) == 2 * 80 * 1 * 128 * 2 == 40_960
    # engine tp 16 > 8 KV heads: vLLM replicates, still one head per GPU
    assert kv_cache_bytes_per_token(LLAMA70B, engine_tp_size=16, kv_bytes=2) == 40_960
    assert engine_weight_bytes(LLAMA70B, engine_tp_size=8, param_bytes=2) == 70_553_706_496 * 2 // 8
    # 141,107,412,992 bytes * 8 bits / 400e9 bit/s = 2.822 s
    assert weight_sync_seconds(LLAMA70B, param_bytes=2, bandwidth_gbps=400) == pytest.approx(2.82214826, rel=1e-8)


def test_fp32_output_layer_working_set_by_hand() -> None:
    # LLAMA_SHAPE's last stage with model.fp32_output_layer and bf16 parameters: 2048 tokens x 16,128 columns,
    # h = 8192. Op phase with fp32 logits: 2*4*2048*16128 = 264,241,152 + two fp32 buffers 264,241,152;
    # the output layer's backward: 4*2048*16128 = 132,120,576 + 10*16128*8192 = 1,321,205,760.
    fp32 = dataclasses.replace(LLAMA_SHAPE, fp32_output_layer=True)
    last = estimate_stage(LLAMA70B, fp32, padded_vocab_size=LLAMA_PADDED_VOCAB, stage=3)
    assert last.logits == max(264_241_152 + 264_241_152, 132_120_576 + 1_321_205_760) == 1_453_326_336
    assert logprob_working_set_bytes(16128, tokens=2048, hidden_size=8192, param_bytes=2, chunk_size=4096,
                                     fp32_output_layer=True) == 1_453_326_336  # fmt: skip
    # no effect with fp32 parameters or without the switch: logits_bytes in the parameter dtype
    for param_bytes, on in ((4, True), (2, False)):
        assert logprob_working_set_bytes(16128, tokens=2048, hidden_size=8192, param_bytes=param_bytes,
                                         chunk_size=4096, fp32_output_layer=on) == logits_bytes(
            16128, tokens=2048, param_bytes=param_bytes, chunk_size=4096)  # fmt: skip
    # a small vocabulary, many tokens: the op phase is the larger (TINY: 128 tokens x 24,576 columns, h 128)
    tiny = estimate_stage(TINY, dataclasses.replace(TINY_SHAPE, fp32_output_layer=True), padded_vocab_size=49152,
                          stage=0)  # fmt: skip
    assert tiny.logits == 2 * 4 * 128 * 24576 + 8 * 128 * 24576  # > 4*128*24576 + 10*24576*128


def test_kl_reference_weights_are_resident() -> None:
    shape = dataclasses.replace(TINY_SHAPE, reference_weights=True)
    memory = estimate_stage(TINY, shape, padded_vocab_size=49152, stage=0)
    assert memory.reference == 2 * 6_439_808  # the frozen bf16 copy of the stage
    plain = estimate_stage(TINY, TINY_SHAPE, padded_vocab_size=49152, stage=0)
    assert plain.reference == 0 and memory.static == plain.static + memory.reference


def test_lora_counts_adapters_as_the_trainable_state() -> None:
    # rank 4 on all seven projections, tp=2 (h 128, q 128, kv 64, f 256), per layer:
    # q 4*(128+64) + k 4*(128+32) + v 4*(128+32) + gate/up 2*4*(128+128) + o 4*(64+128) + down 4*(128+128) = 5888
    shape = dataclasses.replace(TINY_SHAPE, lora_rank=4, lora_projections=(
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))  # fmt: skip
    adapters = 2 * 5888
    memory = estimate_stage(TINY, shape, padded_vocab_size=49152, stage=0)
    assert memory.params == 6_439_808
    assert memory.weights == 2 * (6_439_808 + adapters)
    assert memory.grads == 4 * adapters and memory.optimizer == 12 * adapters
