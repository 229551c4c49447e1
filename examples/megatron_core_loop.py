"""GTPO in your own Megatron-Core loop: your GPTModel and optimizer, gtpo_megatron.plugin, a vLLM rollout engine.

Runs 2 GTPO steps on CPU with the built-in tiny Llama (random weights; the reward is a toy) and prints each step's
metrics:  python examples/megatron_core_loop.py
"""

from __future__ import annotations

import os
import socket

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig
from transformers import AutoConfig, AutoTokenizer

from gtpo_megatron import plugin
from gtpo_megatron.rollout.batch import collate_completions
from gtpo_megatron.rollout.engine import SamplingConfig
from gtpo_megatron.rollout.engine_settings import EngineSettings
from gtpo_megatron.rollout.vllm_engine import VLLMEngine

QUESTIONS = ["What is 3 + 4?", "Name a prime number.", "Count to five.", "What is 10 - 7?"]
ALGORITHM = plugin.AlgorithmConfig(group_size=4)  # GTPO defaults: conflicts, paper entropy filter, gamma 0.1
ROLLOUT = plugin.RolloutConfig(temperature=1.0, max_tokens=16)
MICRO_BATCH_SIZE = 4


def model_provider(hf, tp_size: int = 1, padded_vocab_size: int | None = None) -> GPTModel:
    """Your model: a Megatron-Core GPTModel with the tiny Llama's shapes (parallel_output=True keeps V/tp logits)."""
    config = TransformerConfig(
        num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size, ffn_hidden_size=hf.intermediate_size,
        num_attention_heads=hf.num_attention_heads, num_query_groups=hf.num_key_value_heads, kv_channels=hf.head_dim,
        normalization="RMSNorm", layernorm_epsilon=hf.rms_norm_eps, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp_size, use_cpu_initialization=True, bias_activation_fusion=False,
        masked_softmax_fusion=False,
    )  # fmt: skip
    return GPTModel(
        config, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=padded_vocab_size or hf.vocab_size,
        max_sequence_length=hf.max_position_embeddings, parallel_output=True, position_embedding_type="rope",
        share_embeddings_and_output_weights=hf.tie_word_embeddings, rotary_base=hf.rope_parameters["rope_theta"],
    )  # fmt: skip


def reward(text: str) -> float:
    """Your reward (a toy here: the fraction of letters in the completion)."""
    return sum(ch.isalpha() for ch in text) / max(len(text), 1)


def micro_batches(batch) -> list[plugin.MicroBatch]:
    """The step's rows cut into plugin.MicroBatch es (the local layer spec needs an explicit causal mask)."""
    seq_len = batch.input_ids.shape[1]
    mask = torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)[None, None]
    positions = torch.arange(seq_len).expand(MICRO_BATCH_SIZE, -1)
    parts = []
    for i in range(0, batch.num_sequences, MICRO_BATCH_SIZE):
        rows = batch.select(slice(i, i + MICRO_BATCH_SIZE))  # advantages/token_weights: None before the weights
        # loss_mask: response_mask without the rows the weights remove from the objective (loss_row_mask)
        parts.append(plugin.MicroBatch(input_ids=rows.input_ids, position_ids=positions, attention_mask=mask,
                                       response_mask=rows.loss_mask, advantages=rows.advantages,
                                       token_weights=rows.token_weights))  # fmt: skip
    return parts


def policy_logprobs(model, batch, settings) -> tuple[torch.Tensor, torch.Tensor]:
    """No-grad pass: per-token log-probs and entropy of every row (the entropy feeds GTPO's filter and penalty)."""
    with torch.no_grad():
        parts = [plugin.token_logprobs_entropy(model(m.input_ids, m.position_ids, m.attention_mask), m, settings)
                 for m in micro_batches(batch)]  # fmt: skip
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def main() -> None:
    """Set up the model, optimizer and engine, then run two GTPO steps."""
    with socket.socket() as sock:  # a one-process torch.distributed world (torchrun sets these for you)
        sock.bind(("127.0.0.1", 0))
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(sock.getsockname()[1]))
    groups = plugin.init_distributed(tp_size=1, pp_size=1)
    plugin.install_cpu_compat()  # megatron-core on CPU (no-op with CUDA)
    # The engine starts with dummy weights: the first sync gives it the GPTModel's.
    engine = VLLMEngine("builtin:tiny-llama", EngineSettings(dtype="float32", max_model_len=128, load_format="dummy"))
    hf, tokenizer = AutoConfig.from_pretrained(engine.model_path), AutoTokenizer.from_pretrained(engine.model_path)
    torch.manual_seed(0)
    with plugin.cuda_to_cpu_mode():
        model_parallel_cuda_manual_seed(0)
        model = model_provider(hf)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    spec = plugin.build_loss_spec(ALGORITHM, ROLLOUT)
    plugin.sync_weights(model, engine, hf_config=hf, groups=groups)
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    prompts = [tokenizer.apply_chat_template(c, add_generation_prompt=True)["input_ids"] for c in chats]
    initial_entropy = None
    for step in (1, 2):
        sampling = SamplingConfig(temperature=ROLLOUT.temperature, max_tokens=ROLLOUT.max_tokens, seed=step)
        rollouts = engine.generate(prompts, ALGORITHM.group_size, sampling)
        batch = collate_completions(rollouts, pad_token_id=tokenizer.eos_token_id)
        rewards = torch.tensor([reward(c.text) for g in rollouts for c in g.completions])
        settings = plugin.forward_settings(spec, vocab_size=hf.vocab_size)
        old_logprobs, entropy = policy_logprobs(model, batch, settings)
        seq_entropy = plugin.sequence_mean_entropy(entropy, batch.response_mask)
        initial_entropy = initial_entropy or float(seq_entropy.mean())  # <H>_ini: the first step's mean
        weights = plugin.compute_gtpo_weights(
            batch.input_ids, batch.response_mask, rewards, seq_entropy, ALGORITHM, initial_entropy=initial_entropy
        )
        batch.advantages, batch.token_weights = weights.advantages, weights.token_weights
        batch.loss_row_mask = weights.loss_row_mask
        parts = micro_batches(batch)
        settings = plugin.forward_settings(  # legacy loss form: the step's normaliser N and M micro-batches
            spec, vocab_size=hf.vocab_size, num_microbatches=len(parts),
            normalizer=plugin.loss_normalizer([batch.loss_mask], spec, group=None),
        )  # fmt: skip
        with plugin.cuda_to_cpu_mode():
            store = get_forward_backward_func()(
                forward_step_func=plugin.make_forward_step(settings, per_token=False), data_iterator=iter(parts),
                model=[model], num_microbatches=len(parts), seq_length=batch.input_ids.shape[1],
                micro_batch_size=MICRO_BATCH_SIZE, forward_only=False,
            )  # fmt: skip
        optimizer.step()
        optimizer.zero_grad()
        plugin.sync_weights(model, engine, hf_config=hf, groups=groups)
        rollout_logprobs = batch.rollout_logprobs
        mismatch = (old_logprobs - rollout_logprobs).abs()[batch.response_mask].mean()
        metrics = plugin.reduce_loss_metrics(store, group=None)
        metrics.update({"reward/mean": float(rewards.mean()), "mismatch/abs_logprob_diff": float(mismatch),
                        "gtpo/kept_frac": float(weights.keep_mask.float().mean())})  # fmt: skip
        print(f"step {step}: " + ", ".join(f"{k}={v:.4f}" for k, v in sorted(metrics.items())), flush=True)
    engine.close()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
