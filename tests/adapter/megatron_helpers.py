"""Shared pieces of the Megatron policy tests: deterministic batches, an in-memory HF "checkpoint" reader, the
single-process ``transformers`` reference (logits, log-probs, gradients), shard slicing of HF tensors, and the
logits / HF-weight round-trip checks of a built policy.

The reference never touches Megatron: it runs the HF model in fp32 and computes log-probs the obvious way
(``log_softmax`` then ``gather`` in float64, ``tests/helpers/references.py``).
"""

from __future__ import annotations

import dataclasses

import torch

from gtpo_megatron.batch import TrainBatch
from gtpo_megatron.config import ModelConfig, OptimConfig, ParallelConfig
from gtpo_megatron.megatron_adapter.settings import PolicySettings
from gtpo_megatron.plan.micro_batches import TokenBudget
from tests.helpers.references import ref_logprobs_entropy

TINY_QWEN2 = "builtin:tiny-qwen2"
TINY_LLAMA = "builtin:tiny-llama"
SMOLLM2 = "builtin:smollm2-135m-instruct"
LOGITS_ATOL = 1e-4  # fp32 transformer stacks (up to 30 layers) with different matmul splits and orders


def model_section(path: str, **fields) -> ModelConfig:
    """The model section of a test policy: fp32 parameters unless ``fields`` say otherwise."""
    return ModelConfig(**{"name_or_path": path, "params_dtype": "float32", **fields})


TEST_OPTIM = OptimConfig(clip_grad=1.0)
"""The optim section of a test policy unless it names one: lr 1e-6, gradients clipped at norm 1."""


def settings_at(
    groups,
    model: ModelConfig,
    *,
    optim: OptimConfig = TEST_OPTIM,
    micro_batch_size: int = 1,
    token_budget: TokenBudget | None = None,
    sequence_parallel: bool = False,
    use_distributed_optimizer: bool = False,
    **fields,
) -> PolicySettings:
    """``PolicySettings`` of a test policy of ``model`` at the TP/PP/EP layout of ``groups``; ``optim`` with
    ``micro_batch_size`` rows or ``token_budget``; ``fields``: ``schedule``, ``adam_eps``, ``seed``, ..."""
    parallel = ParallelConfig(
        tp_size=groups.tp_size,
        pp_size=groups.pp_size,
        ep_size=groups.ep_size,
        sequence_parallel=sequence_parallel,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    budget = {} if token_budget is None else {"max_tokens_per_micro_batch": token_budget.max_tokens,
                                               "packing": token_budget.packing}  # fmt: skip
    optim = dataclasses.replace(optim, micro_batch_size=micro_batch_size, **budget)
    return PolicySettings(model=model, parallel=parallel, optim=optim, **fields)


def make_batch(
    *, rows: int = 4, seq_len: int = 12, vocab_size: int = 49152, seed: int = 0, prompt_len: int = 3
) -> TrainBatch:
    """Right-padded random batch: varied lengths (one row fully padded after its prompt: no response tokens),
    random advantages of both signs and per-token weights in {0, 0.5..2} on the response."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab_size, (rows, seq_len), generator=gen)
    lengths = torch.randint(prompt_len + 1, seq_len + 1, (rows,), generator=gen)
    lengths[-1] = prompt_len  # a row without response tokens must contribute nothing
    columns = torch.arange(seq_len)
    attention_mask = columns[None] < lengths[:, None]
    response_mask = attention_mask & (columns[None] >= prompt_len)
    weights = torch.rand(rows, seq_len, generator=gen) * 2
    weights[weights < 0.3] = 0.0
    return TrainBatch(
        input_ids=input_ids,
        token_mask=attention_mask,
        response_mask=response_mask,
        advantages=torch.randn(rows, generator=gen),
        token_weights=weights * response_mask,
    )


class DictReader:
    """``HFCheckpointReader`` interface over an in-memory ``{hf_name: tensor}`` dict (used to shard HF grads)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> list[int]:
        return list(self.tensors[name].shape)

    def read(self, name, dim=0, start=None, stop=None):
        tensor = self.tensors[name]
        if start is None:
            return tensor.clone()
        return tensor[start:stop].clone() if dim == 0 else tensor[:, start:stop].clone()


def save_random_hf_model(out_dir: str, config, *, tokenizer_from: str | None = None) -> None:
    """A seeded random HF model of ``config`` with perturbed 1-D weights (norms, biases: not all ones/zeros, so
    a mis-mapped norm shows), saved to ``out_dir``; ``tokenizer_from`` also copies a tokenizer there."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(0.2 * torch.randn_like(param))
    model.save_pretrained(out_dir)
    if tokenizer_from is not None:
        AutoTokenizer.from_pretrained(tokenizer_from).save_pretrained(out_dir)


def load_hf_model(path: str):
    from transformers import AutoModelForCausalLM

    from gtpo_megatron.builtin_models import resolve_model_path

    return AutoModelForCausalLM.from_pretrained(resolve_model_path(path), dtype=torch.float32).eval()


def reference_token_logprobs(hf_model, batch: TrainBatch, *, temperature: float = 1.0):
    """``(logprobs, entropy)`` ``[B, S]`` in the TrainBatch column convention (column s predicts token s), float64,
    differentiable w.r.t. the HF parameters, 0 off ``response_mask``."""
    logits = hf_model(batch.input_ids).logits
    logprobs, entropy = ref_logprobs_entropy(logits[:, :-1], batch.input_ids[:, 1:], temperature=temperature)
    mask = batch.response_mask[:, 1:]
    pad = torch.nn.functional.pad
    return pad(torch.where(mask, logprobs, 0.0), (1, 0)), pad(torch.where(mask, entropy, 0.0), (1, 0))


def reference_grads(
    hf_model, batch: TrainBatch, *, loss_name: str, aggregation: str, clip_eps: float = 0.2
) -> tuple[float, dict[str, torch.Tensor]]:
    """Single-process loss and gradient of every HF parameter for the whole ``batch`` (one micro-batch)."""
    from gtpo_megatron.ops import LossSpec, compute_normalizer, policy_loss

    hf_model.zero_grad(set_to_none=True)
    logprobs, _ = reference_token_logprobs(hf_model, batch)
    loss, _ = policy_loss(
        policy_logprobs=logprobs.float(),
        old_logprobs=batch.old_logprobs,
        advantages=batch.advantages,
        token_weights=batch.token_weights,
        response_mask=batch.response_mask,
        normalizer=compute_normalizer(batch.response_mask, aggregation),
        spec=LossSpec(loss_name=loss_name, aggregation=aggregation, clip_eps_low=clip_eps, clip_eps_high=clip_eps),
    )
    loss.backward()
    # With tied embeddings the single HF parameter's gradient already sums both uses.
    return float(loss), {name: p.grad.detach().clone() for name, p in hf_model.named_parameters()}


def megatron_named_params(policy):
    """``(global_megatron_name, param)`` of this rank's stage (the names ``hf_conversion`` maps)."""
    from gtpo_megatron.megatron_adapter import hf_conversion

    yield from hf_conversion.global_named_parameters(policy.model)


def megatron_logits(policy, input_ids: torch.Tensor) -> torch.Tensor | None:
    """Last-stage ``[B, S, V/tp]`` logits through Megatron's forward-only schedule (None on other stages)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from gtpo_megatron.megatron_adapter.cpu_compat import cuda_to_cpu_mode
    from gtpo_megatron.megatron_adapter.model import causal_attention_mask

    rows, seq_len = input_ids.shape
    positions = torch.arange(seq_len).expand(rows, -1)
    mask = causal_attention_mask(seq_len, policy.model.layer_spec_backend)

    def step(data_iterator, model):
        output = model(next(data_iterator), positions, mask)
        return output, lambda out: (out.sum() * 0, {"logits": out.detach().clone()})

    with cuda_to_cpu_mode(), torch.no_grad():
        store = get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=iter([input_ids]),
            model=[policy.ddp_model],
            num_microbatches=1,
            seq_length=seq_len,
            micro_batch_size=rows,
            forward_only=True,
        )
    return store[0]["logits"] if policy.groups.is_last_pp_stage else None


def check_logits(policy, hf_model, label: str) -> None:
    """Last-stage vocab-parallel logits of a fixed ``[2, 16]`` input equal ``hf_model``'s on this rank's real
    columns (atol ``LOGITS_ATOL``) and are exactly 0 on padded vocabulary columns; prints the max difference."""
    input_ids = torch.randint(0, hf_model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    logits = megatron_logits(policy, input_ids)
    if logits is None:
        return
    with torch.no_grad():
        reference = hf_model(input_ids).logits
    width, vocab = logits.shape[-1], hf_model.config.vocab_size
    start = policy.groups.tp_rank * width
    real = max(0, min(width, vocab - start))
    diff = (logits[..., :real] - reference[..., start : start + real]).abs().max().item() if real else 0.0
    assert diff <= LOGITS_ATOL, f"{label}: logits differ by {diff}"
    assert bool((logits[..., real:] == 0).all()), f"{label}: padded vocabulary logits are not 0"
    print(f"[logits parity] {label}: max |logits diff| = {diff:.3e} (padded columns on this rank: {width - real})")


def check_hf_weights(policy, path: str, label: str) -> None:
    """``policy.iter_hf_weights()`` yields exactly the names of the HF checkpoint at ``path``, each once and
    ``torch.equal`` to the original."""
    from safetensors import safe_open

    from gtpo_megatron.builtin_models import resolve_model_path

    with safe_open(f"{resolve_model_path(path)}/model.safetensors", "pt") as original:
        expected_names = set(original.keys())
        seen = set()
        for name, tensor in policy.iter_hf_weights():
            assert name not in seen, f"{label}: {name} yielded twice"
            seen.add(name)
            assert torch.equal(tensor, original.get_tensor(name)), f"{label}: {name} differs after the gather"
    assert seen == expected_names, f"{label}: names differ: {sorted(seen ^ expected_names)}"
