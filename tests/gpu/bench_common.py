"""What the GPU benchmarks share: timing, CUDA peak memory, random models of a ``plan.architectures`` shape, batches,
model FLOPs and ``gtpo-plan``'s memory estimate.

Model FLOPs per token: ``6 * P_matmul + 12 * L * s * q_width``, ``P_matmul`` the matmul parameters one token passes
through (attention, the SwiGLU or the router and ``k`` experts, the output layer), the attention score and value
products counted in full (the local specs compute the whole square).
"""

from __future__ import annotations

import json
import statistics
import time
from unittest import mock

import torch

from gtpo_megatron.plan.architectures import Architecture
from tests.gpu.common import DEVICE

PEAK_FLOPS = 989e12
"""H200 SXM dense bf16 peak, FLOP/s (NVIDIA's data sheet; 1,979 with 2:4 sparsity; the H100 SXM's is the same)."""
HBM_BYTES_PER_S = 4.8e12
"""H200 HBM3e bandwidth, bytes/s (data sheet; H100 SXM: 3.35e12)."""
CHUNK = 1024
GIB = 2**30


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def median_seconds(fn, repeats: int) -> float:
    """Median wall time of ``repeats`` calls of ``fn`` after one warm-up call, seconds."""
    fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def peak_extra_bytes(fn) -> float:
    """CUDA bytes above what was allocated before ``fn`` at its peak (NaN in a dry run: no CUDA statistics)."""
    if DEVICE.type != "cuda":
        fn()
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def config_folder(arch: Architecture, folder) -> str:
    """A ``config.json`` of ``arch`` (a Qwen2 decoder, or Qwen3-MoE when it has experts) and nothing else."""
    config = {
        "hidden_size": arch.hidden_size, "num_hidden_layers": arch.num_layers, "vocab_size": arch.vocab_size,
        "num_attention_heads": arch.num_attention_heads, "num_key_value_heads": arch.num_query_groups,
        "tie_word_embeddings": arch.tied_embeddings, "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1e6,
        "max_position_embeddings": 32768, "use_sliding_window": False,
    }  # fmt: skip
    if arch.num_experts:
        config.update(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], head_dim=arch.head_dim,
                      intermediate_size=arch.ffn_hidden_size, moe_intermediate_size=arch.expert_ffn_size,
                      num_experts=arch.num_experts, num_experts_per_tok=arch.top_k, norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[])  # fmt: skip
    else:
        config.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"], intermediate_size=arch.ffn_hidden_size)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def random_policy(groups, arch: Architecture, folder, *, lora_rank: int | None = None):
    """A bf16 ``MegatronPolicy`` of ``arch`` with Megatron's random initialisation (no weights are read), Adam at
    1e-6 with clipping 1.0; ``lora_rank``: adapters of that rank (alpha = rank) on all seven projections."""
    from gtpo_megatron.config import ModelConfig, OptimConfig
    from gtpo_megatron.config.lora import LoRAConfig
    from gtpo_megatron.megatron_adapter import policy as policy_module
    from gtpo_megatron.megatron_adapter.settings import PolicySettings

    lora = LoRAConfig(rank=lora_rank) if lora_rank else LoRAConfig()
    model = ModelConfig(name_or_path=config_folder(arch, folder), params_dtype="bfloat16", lora=lora)
    settings = PolicySettings(model=model, logprob_chunk_size=CHUNK, optim=OptimConfig(lr=1e-6, clip_grad=1.0))
    with mock.patch.object(policy_module, "_load_initial_weights", lambda *args, **kwargs: None):
        return policy_module.MegatronPolicy.from_pretrained(settings, groups=groups)


def random_batch(arch: Architecture, rows: int, seq_len: int, *, group_size: int = 1, seed: int = 0):
    """Random prompt + response rows (prompt 1/8 of the sequence); groups share the first half of the response."""
    from gtpo_megatron.batch import TrainBatch

    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, arch.vocab_size, (rows, seq_len), generator=gen)
    prompt, half = seq_len // 8, seq_len // 8 + (seq_len - seq_len // 8) // 2
    input_ids[:, :half] = input_ids[::group_size].repeat_interleave(group_size, 0)[:, :half]
    response = torch.arange(seq_len)[None, :].expand(rows, -1) >= prompt
    return TrainBatch(input_ids=input_ids, token_mask=torch.ones(rows, seq_len, dtype=torch.bool),
                      response_mask=response.clone(), advantages=torch.randn(rows, generator=gen),
                      token_weights=response.float())  # fmt: skip


def flops_per_token(arch: Architecture, seq_len: int, padded_vocab: int) -> float:
    """Model FLOPs of one trained token (forward + backward), the module docstring's formula."""
    h = arch.hidden_size
    attention = h * (arch.q_width + 2 * arch.kv_width) + arch.q_width * h
    matmul_params = arch.num_layers * (attention + arch.mlp_params(arch.top_k)) + padded_vocab * h
    return 6 * matmul_params + 12 * arch.num_layers * seq_len * arch.q_width


def plan_bytes(arch: Architecture, seq_len: int, rows: int, padded_vocab: int, *, lora_rank: int | None = None) -> int:
    """``gtpo-plan``'s training memory of one GPU (TP = PP = EP = 1, micro-batch 1, ``rows`` micro-batches)."""
    from gtpo_megatron.config.lora import LORA_PROJECTIONS
    from gtpo_megatron.plan.memory import TrainingShape, estimate_stage

    shape = TrainingShape(tp_size=1, pp_size=1, dp_size=1, micro_batch_size=1, seq_length=seq_len,
                          num_microbatches=rows, param_bytes=2, logprob_chunk_size=CHUNK, lora_rank=lora_rank,
                          lora_projections=LORA_PROJECTIONS if lora_rank else ())  # fmt: skip
    return estimate_stage(arch, shape, padded_vocab_size=padded_vocab, stage=0).total
