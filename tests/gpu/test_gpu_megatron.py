"""Megatron-Core on one GPU (TP = PP = 1, one NCCL rank): forward parity with transformers, one training step.

* The policy's log-probs and entropies of a fixed batch (``MegatronPolicy.compute_logprobs``: Megatron's schedule,
  the vocab-parallel op) against the float64 ``transformers`` model on the same weights: fp32 parameters, and bf16
  parameters with and without the fp32 output layer (``output_layer.use_fp32_output_layer``, the mechanism
  ``build_gpt_model(fp32_output_layer=True)`` applies). The max log-prob error of each is reported.
* One ``train_step`` on NCCL with the real ``MegatronPolicy`` (bf16): the loss equals the float64 loss of the same
  log-probs, the gradient norm is finite and non-zero, the weights move.
* Transformer Engine layer specs, when TE imports ("skipped: no TE" otherwise).

Model: ``tests.gpu.common.MODEL`` (``builtin:tiny-llama``: 2 layers, hidden 128, vocabulary 49,152, tied
embeddings). In a dry run everything runs on the CPU with gloo.
"""

from __future__ import annotations

import pytest
import torch

from tests.adapter.megatron_helpers import load_hf_model, make_batch, reference_token_logprobs
from tests.gpu.common import MODEL, build_policy, check_train_step, needs_module
from tests.gpu.report import record

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def batch():
    return make_batch(rows=4, seq_len=64, vocab_size=49152, seed=1, prompt_len=8)


@pytest.fixture(scope="module")
def reference(batch):
    """float64 ``(logprobs, entropy)`` ``[B, S]`` of the HF model (its fp32 weights, exactly, in float64)."""
    with torch.no_grad():
        logprobs, entropy = reference_token_logprobs(load_hf_model(MODEL).double(), batch)
    return logprobs, entropy


@pytest.mark.parametrize(
    ("params_dtype", "fp32_output_layer", "limit"),
    # fp32: matmul order only; bf16: weights and activations rounded to 8 bits (2 layers, random weights)
    [("float32", False, 1e-4), ("bfloat16", False, 0.25), ("bfloat16", True, 0.25)],
    ids=["fp32", "bf16", "bf16-fp32_output_layer"],
)
def test_forward_logprobs_vs_float64(groups, batch, reference, params_dtype, fp32_output_layer, limit) -> None:
    from gtpo_megatron.megatron_adapter.output_layer import use_fp32_output_layer

    policy = build_policy(groups, MODEL, params_dtype)
    if fp32_output_layer:
        use_fp32_output_layer(policy.model.output_layer)
    logprobs, entropy = policy.compute_logprobs(batch)
    mask = batch.response_mask
    lp_err = (logprobs.double() - reference[0])[mask].abs().max().item()
    h_err = (entropy.double() - reference[1])[mask].abs().max().item()
    name = f"{params_dtype}{' + fp32 output layer' if fp32_output_layer else ''}"
    check = "test_forward_logprobs_vs_float64"
    record(check, f"max |logprob - float64| {name}", lp_err, limit=limit, unit="nats")
    record(check, f"max |entropy - float64| {name}", h_err, unit="nats")
    record(check, f"layer specs: {policy.model.layer_spec_backend}", 1.0)
    assert lp_err <= limit and h_err <= 10 * limit


def test_train_step_on_nccl(groups, batch) -> None:
    import torch.distributed as dist

    # lr 1e-3: one Adam step must move bf16 weights visibly (a 1e-6 step is below bf16 resolution)
    policy = build_policy(groups, MODEL, "bfloat16", lr=1e-3)
    record("test_train_step_on_nccl", f"backend {dist.get_backend()}", 1.0)
    check_train_step(policy, batch, "test_train_step_on_nccl", next(policy.model.parameters()))


def test_transformer_engine_specs(groups, batch, reference) -> None:
    needs_module("transformer_engine", "TE")
    policy = build_policy(groups, MODEL, "float32")
    assert policy.model.layer_spec_backend == "transformer_engine"
    logprobs, _ = policy.compute_logprobs(batch)
    error = (logprobs.double() - reference[0])[batch.response_mask].abs().max().item()
    record("test_transformer_engine_specs", "max |logprob - float64| fp32, TE specs", error, limit=1e-3, unit="nats")
    assert error <= 1e-3
