"""A mixture-of-experts policy on one GPU (TP = PP = EP = 1, one NCCL rank): parity with transformers, one step.

The model is built here from a config with random weights (a Qwen3-MoE of 2 layers, 8 experts of width 64,
renormalised top-2, vocabulary 300: nothing to carry to the machine):

* ``compute_logprobs`` (Megatron's MoE layer: the ``alltoall`` dispatcher, ``SequentialMLP`` or, when Transformer
  Engine imports, its grouped GEMM) against the fp32 ``transformers`` model on the same weights, fp32 and bf16
  parameters; the layer-spec backend is recorded;
* one ``train_step`` on NCCL (bf16): the loss equals the float64 loss of the same log-probs, the gradient norm is
  finite and non-zero, an expert's weights move, and the router load is reported.

In a dry run everything runs on the CPU with gloo.
"""

from __future__ import annotations

import pytest
import torch

from gtpo_megatron.config import ModelConfig
from gtpo_megatron.ops import LossSpec
from tests.adapter.megatron_helpers import load_hf_model, make_batch, reference_token_logprobs, save_random_hf_model
from tests.gpu.common import reference_train_loss, single_rank_world
from tests.gpu.report import record

pytestmark = pytest.mark.gpu
LOSS = LossSpec(loss_name="gtpo", aggregation="seq-mean-token-mean", clip_eps_low=0.2, clip_eps_high=0.2)
VOCAB = 300


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
        norm_topk_prob=True,
    )  # fmt: skip
    path = str(tmp_path_factory.mktemp("tiny-qwen3-moe"))
    save_random_hf_model(path, config)
    return path


@pytest.fixture(scope="module")
def groups():
    with single_rank_world() as groups:
        yield groups


@pytest.fixture(scope="module")
def batch():
    return make_batch(rows=4, seq_len=64, vocab_size=VOCAB, seed=1, prompt_len=8)


def _policy(groups, path: str, params_dtype: str, **settings):
    from gtpo_megatron.megatron_adapter.policy import MegatronPolicy
    from gtpo_megatron.megatron_adapter.settings import PolicySettings

    model = ModelConfig(name_or_path=path, params_dtype=params_dtype, make_vocab_size_divisible_by=4)
    return MegatronPolicy.from_pretrained(PolicySettings(model=model, micro_batch_size=2, **settings), groups=groups)


@pytest.mark.parametrize(("params_dtype", "limit"), [("float32", 1e-4), ("bfloat16", 0.25)], ids=["fp32", "bf16"])
def test_moe_forward_logprobs_vs_transformers(groups, model_path, batch, params_dtype, limit) -> None:
    with torch.no_grad():
        # fp32 HF model (its grouped expert GEMM has no float64), log-softmax in float64
        reference, _ = reference_token_logprobs(load_hf_model(model_path), batch)
    policy = _policy(groups, model_path, params_dtype)
    logprobs, _ = policy.compute_logprobs(batch)
    error = (logprobs.double() - reference)[batch.response_mask].abs().max().item()
    check = "test_moe_forward_logprobs_vs_transformers"
    record(check, f"max |logprob - transformers| {params_dtype}", error, limit=limit, unit="nats")
    record(check, f"layer specs: {policy.model.layer_spec_backend}", 1.0)
    assert error <= limit


def test_moe_train_step_on_nccl(groups, model_path, batch) -> None:
    from gtpo_megatron.megatron_adapter.settings import OptimSettings

    policy = _policy(groups, model_path, "bfloat16", optim=OptimSettings(lr=1e-3, clip_grad=1.0))
    logprobs, _ = policy.compute_logprobs(batch)
    batch.old_logprobs = torch.where(batch.response_mask, logprobs + 0.1 * torch.randn_like(logprobs), 0.0)
    expert = next(p for n, p in policy.model.named_parameters() if ".experts." in n)
    before = expert.detach().clone()
    metrics = policy.train_step(batch, LOSS)
    expected = reference_train_loss(logprobs, batch)
    batch.old_logprobs = None
    check = "test_moe_train_step_on_nccl"
    limit = 1e-2 * (1 + abs(expected))
    record(check, "|loss - float64 reference|", abs(metrics["loss"] - expected), limit=limit)
    record(check, "grad norm", metrics["grad_norm"])
    record(check, "expert load max / min", metrics["moe_expert_load_max"] / max(metrics["moe_expert_load_min"], 1e-9))
    assert abs(metrics["loss"] - expected) <= limit
    assert torch.isfinite(torch.tensor(metrics["grad_norm"])) and metrics["grad_norm"] > 0
    assert not torch.equal(before, expert.detach())
