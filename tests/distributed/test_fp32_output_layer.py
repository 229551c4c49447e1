"""fp32 output layer (``model.fp32_output_layer``) on 2 gloo ranks, bf16 parameters, vs float64 references.

* Megatron's ``ColumnParallelLinear`` at TP=2 with ``use_fp32_output_layer``: fp32 logits equal the float64 product
  of the same bf16 input and weight; the input gradient (through Megatron's TP all-reduce) and each rank's weight
  gradient shard equal the float64 ones up to their bf16 rounding.
* A random tied tiny Llama (hidden 64, vocabulary 1000) at TP=1 and TP=2: the op's log-probs from the model's
  logits vs float64 log-probs of the same bf16 hidden states and weight: about 1e-7 with the fp32 output layer,
  1e-3 without (the switch must matter), about 1e-7 with fp32 parameters (printed); the tied embedding weight
  receives the output layer's gradient (rows of tokens absent from the input, where only the output layer
  contributes, vs float64).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.adapter.megatron_helpers import model_section, save_random_hf_model, settings_at
from tests.helpers.dist_harness import run_distributed
from tests.helpers.tiny_configs import tiny_llama

pytestmark = pytest.mark.distributed
VOCAB, HIDDEN = 1000, 64


def _check_layer(groups) -> None:
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer import TransformerConfig

    from gtpo_megatron.megatron_adapter.cpu_compat import cuda_to_cpu_mode
    from gtpo_megatron.megatron_adapter.output_layer import use_fp32_output_layer

    config = TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        params_dtype=torch.bfloat16,
        bf16=True,
        use_cpu_initialization=True,
        tensor_model_parallel_size=groups.tp_size,
    )
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen).bfloat16()
    x_full = torch.randn(5, 2, HIDDEN, generator=gen).bfloat16()
    g_full = torch.randn(5, 2, VOCAB, generator=gen)
    rows = slice(groups.tp_rank * VOCAB // groups.tp_size, (groups.tp_rank + 1) * VOCAB // groups.tp_size)
    with cuda_to_cpu_mode():
        layer = ColumnParallelLinear(
            HIDDEN,
            VOCAB,
            config=config,
            init_method=torch.nn.init.zeros_,
            bias=False,
            gather_output=False,
            tp_group=groups.tp,
        )
    layer.weight.data.copy_(weight[rows])
    use_fp32_output_layer(layer)
    use_fp32_output_layer(layer)  # idempotent
    x = x_full.clone().requires_grad_()
    logits, _ = layer(x)
    assert logits.dtype == torch.float32
    (logits * g_full[..., rows]).sum().backward()
    ref_x, ref_w = x_full.double().requires_grad_(), weight.double().requires_grad_()
    ref_logits = ref_x @ ref_w.T
    (ref_logits * g_full.double()).sum().backward()
    # fp32 products of bf16 numbers (exact in fp32) summed over 64 terms: fp32 rounding only
    torch.testing.assert_close(logits.double(), ref_logits[..., rows].detach(), atol=1e-5, rtol=1e-6)
    assert x.grad.dtype == torch.bfloat16 and layer.weight.grad.dtype == torch.bfloat16
    # gradients are rounded to bf16 (2**-8 relative)
    torch.testing.assert_close(x.grad.double(), ref_x.grad, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(layer.weight.grad.double(), ref_w.grad[rows], atol=1e-2, rtol=1e-2)


def _build(path: str, groups, params_dtype: torch.dtype, fp32_output_layer: bool):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from transformers import AutoConfig

    from gtpo_megatron.megatron_adapter import hf_conversion, hf_loading
    from gtpo_megatron.megatron_adapter import model as model_lib
    from gtpo_megatron.megatron_adapter.cpu_compat import cuda_to_cpu_mode
    from gtpo_megatron.plan.layout import padded_vocab_size

    hf_config = AutoConfig.from_pretrained(path)
    model = model_section(path, params_dtype=str(params_dtype).removeprefix("torch."))
    config = model_lib.transformer_config_from_hf(hf_config, settings_at(groups, model))
    padded = padded_vocab_size(VOCAB, make_vocab_size_divisible_by=128, tp_size=groups.tp_size)
    with cuda_to_cpu_mode():
        model_parallel_cuda_manual_seed(0)
        model = model_lib.build_gpt_model(
            hf_config,
            config,
            padded_vocab_size=padded,
            pre_process=True,
            post_process=True,
            fp32_output_layer=fp32_output_layer,
        )
    geometry = hf_conversion.ModelGeometry.from_hf(hf_config, padded_vocab_size=padded, tp_size=groups.tp_size)
    hf_loading.load_hf_weights(model, path, geometry, tp_rank=groups.tp_rank)
    return model, padded // groups.tp_size


def _model_error(path: str, groups, params_dtype: torch.dtype, fp32_output_layer: bool) -> float:
    """Max |log-prob - float64 reference| on this rank; checks the tied weight gradient with the fp32 layer."""
    from safetensors.torch import load_file

    from gtpo_megatron.megatron_adapter.cpu_compat import cuda_to_cpu_mode
    from gtpo_megatron.megatron_adapter.model import causal_attention_mask
    from gtpo_megatron.ops import vocab_parallel_logprobs_entropy

    model, width = _build(path, groups, params_dtype, fp32_output_layer)
    ids = torch.randint(0, VOCAB // 2, (2, 12), generator=torch.Generator().manual_seed(2))  # rows >= 500 unused
    hidden = []
    model.output_layer.register_forward_hook(lambda module, args, output: hidden.append(args[0].detach()))
    with cuda_to_cpu_mode():
        logits = model(ids, torch.arange(12).expand(2, -1), causal_attention_mask(12, model.layer_spec_backend))
        assert logits.dtype == (torch.float32 if fp32_output_layer else params_dtype)
        logprobs, _ = vocab_parallel_logprobs_entropy(logits[:, :-1], ids[:, 1:], tp_group=groups.tp, vocab_size=VOCAB)
        logprobs.sum().backward()
    weight = load_file(f"{path}/model.safetensors")["model.embed_tokens.weight"].to(params_dtype).double()
    h = hidden[0].transpose(0, 1).double()[:, :-1]  # [b, S-1, H], the bf16 values the layer read
    ref_logprobs = torch.log_softmax(h @ weight.T, dim=-1)
    error = (logprobs.double() - ref_logprobs.gather(-1, ids[:, 1:, None]).squeeze(-1)).abs().max().item()
    if fp32_output_layer:  # d sum(logprobs) / d W = (onehot - softmax)^T h; only rows >= 500 (unused as inputs)
        grad_logits = torch.nn.functional.one_hot(ids[:, 1:], VOCAB).double() - ref_logprobs.exp()
        ref_grad = torch.einsum("bsv,bsh->vh", grad_logits, h)
        start = groups.tp_rank * width
        rows = torch.arange(max(start, 500), min(start + width, VOCAB))
        got = model.embedding.word_embeddings.weight.grad[rows - start].double()
        torch.testing.assert_close(got, ref_grad[rows], atol=1e-4, rtol=2e-2)  # bf16-rounded gradient
    return error


def _worker(rank: int, world_size: int, out_root: str) -> None:

    from gtpo_megatron.parallel.groups import init_distributed

    path = f"{out_root}/tiny-llama-tied"
    if rank == 0:
        save_random_hf_model(
            path,
            tiny_llama(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, tie_word_embeddings=True),
        )
    dist.barrier()
    _check_layer(init_distributed(tp_size=2))
    for tp in (1, 2):
        groups = init_distributed(tp_size=tp)
        fp32_error = _model_error(path, groups, torch.bfloat16, True)
        bf16_error = _model_error(path, groups, torch.bfloat16, False)
        fp32_params_error = _model_error(path, groups, torch.float32, False)
        print(
            f"[fp32 output layer] tp={tp} rank={rank}: max |logprob - float64|, bf16 params: bf16 layer "
            f"{bf16_error:.2e}, fp32 layer {fp32_error:.2e}; fp32 params: {fp32_params_error:.2e}"
        )
        assert fp32_params_error < 1e-5, fp32_params_error
        assert fp32_error < 1e-5, fp32_error  # fp32 softmax of fp32 logits of bf16 operands: about 1e-7
        assert bf16_error > 10 * fp32_error and bf16_error > 1e-4, bf16_error  # the rounding this layer removes


def test_fp32_output_layer_matches_float64(tmp_path):
    run_distributed(_worker, 2, str(tmp_path))
