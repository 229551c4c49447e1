"""A mixture-of-experts policy on one GPU (TP = PP = EP = 1, one NCCL rank): parity with transformers, one step.

The model is built here from a config with random weights (``tests.helpers.tiny_configs.tiny_moe("qwen3_moe")``:
2 layers, 4 experts of width 32, renormalised top-2, vocabulary 300: nothing to carry to the machine):

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

from tests.adapter.megatron_helpers import load_hf_model, make_batch, reference_token_logprobs, save_random_hf_model
from tests.gpu.common import build_policy, check_train_step
from tests.gpu.report import record
from tests.helpers.tiny_configs import TINY, tiny_moe

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny-qwen3-moe"))
    save_random_hf_model(path, tiny_moe("qwen3_moe"))
    return path


@pytest.fixture(scope="module")
def batch():
    return make_batch(rows=4, seq_len=64, vocab_size=TINY["vocab_size"], seed=1, prompt_len=8)


@pytest.mark.parametrize(("params_dtype", "limit"), [("float32", 1e-4), ("bfloat16", 0.25)], ids=["fp32", "bf16"])
def test_moe_forward_logprobs_vs_transformers(groups, model_path, batch, params_dtype, limit) -> None:
    with torch.no_grad():
        # fp32 HF model (its grouped expert GEMM has no float64), log-softmax in float64
        reference, _ = reference_token_logprobs(load_hf_model(model_path), batch)
    policy = build_policy(groups, model_path, params_dtype, make_vocab_size_divisible_by=4)
    logprobs, _ = policy.compute_logprobs(batch)
    error = (logprobs.double() - reference)[batch.response_mask].abs().max().item()
    check = "test_moe_forward_logprobs_vs_transformers"
    record(check, f"max |logprob - transformers| {params_dtype}", error, limit=limit, unit="nats")
    record(check, f"layer specs: {policy.model.layer_spec_backend}", 1.0)
    assert error <= limit


def test_moe_train_step_on_nccl(groups, model_path, batch) -> None:
    policy = build_policy(groups, model_path, "bfloat16", lr=1e-3, make_vocab_size_divisible_by=4)
    expert = next(p for n, p in policy.model.named_parameters() if ".experts." in n)
    metrics = check_train_step(policy, batch, "test_moe_train_step_on_nccl", expert)
    load = metrics["moe_expert_load_max"] / max(metrics["moe_expert_load_min"], 1e-9)
    record("test_moe_train_step_on_nccl", "expert load max / min", load)
