"""The loop's orchestration with fakes in a one-process gloo world: phases, metrics, checkpoints, resume, SIGTERM."""

from __future__ import annotations

import json
import logging
import math
import os

import pytest
import torch

from gtpo_megatron.logging import format_step_line
from gtpo_megatron.run_dir import list_checkpoints
from tests.trainer.fakes import (
    FakeEngine,
    FakePolicy,
    FakeRewardPool,
    FakeTokenizer,
    make_trainer,
    one_rank_process_group,
)

CONTRACT_KEYS = {
    "reward/mean",
    "accuracy",
    "entropy/completion_mean",
    "entropy/token_mean",
    "entropy/initial",
    "advantage/abs_mean",
    "gtpo/filtered_frac",
    "gtpo/conflict_frac",
    "time/step_s",
    "reward/std",
    "format_rate",
    "response/length_mean",
    "gtpo/conflict_frac_pos",
    "gtpo/conflict_frac_neg",
    "train/clip_frac",
    "train/grad_norm",
    "train/lr",
    "time/rollout_s",
    "time/old_logprob_s",
    "time/train_s",
    "time/sync_s",
    "perf/tokens_per_s",
    "mismatch/abs_logprob_diff",
    "mismatch/prob_ratio_err",
}


one_rank_world = pytest.fixture(scope="module", autouse=True)(one_rank_process_group)


def test_step_phases_feed_the_policy_and_engine(tmp_path):
    trainer = make_trainer(tmp_path)
    metrics = trainer.step(1)
    assert CONTRACT_KEYS <= set(metrics)
    batch, loss, terms = trainer.policy.train_batches[0]
    # Completion texts alternate "9" (reward 1) / "0" (0): group_mean advantages +-0.5 minus 0.1 * <H>_i with
    # <H>_i = 0.25 * (row % 4) from the fake policy (docs/algorithm.md sections 2 and 4); the loss subtracts it.
    entropy = 0.25 * (torch.arange(8) % 4).float()
    torch.testing.assert_close(batch.advantages, torch.tensor([0.5, -0.5, 0.5, -0.5] * 2))
    torch.testing.assert_close(terms.advantages, torch.tensor([0.5, -0.5, 0.5, -0.5] * 2) - 0.1 * entropy)
    assert trainer.initial_entropy.value == pytest.approx(float(entropy.mean()))  # 0.375 <= ln 2: the filter is active
    assert loss.initial_entropy == trainer.initial_entropy.value and loss.entropy_temperature == 1.0
    assert batch.old_logprobs is None and loss.loss_name == "gtpo" and loss.temperature == 0.9
    assert metrics["accuracy"] == 0.5 and metrics["reward/mean"] == 0.5
    assert metrics["gtpo/filtered_frac"] == pytest.approx(2 / 8)  # rows with <H> = 0.75 > ln 2
    assert metrics["entropy/completion_mean"] == pytest.approx(0.375)
    assert metrics["advantage/abs_mean"] == pytest.approx(float((terms.advantages.abs()).mean()))
    assert metrics["time/old_logprob_s"] > 0  # step 1 of the paper filter measures <H>_ini first
    assert metrics["mismatch/abs_logprob_diff"] == pytest.approx(0.25)  # |-1 - (-1)| and |-1 - (-0.5)|
    assert trainer.collector.engine.events == ["sleep", "wake_up", "synced"]
    assert trainer.collector.engine.pushed == [["model.embed_tokens.weight", "lm_head.weight"]]
    sampling = trainer.collector.engine.calls[0][2]
    assert (sampling.seed, sampling.max_tokens, sampling.temperature) == (1000, 1500, 0.9)


def test_run_writes_metrics_curves_and_prunes_checkpoints(tmp_path):
    trainer = make_trainer(tmp_path)
    trainer.run()
    trainer.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4]
    assert (tmp_path / "curves.png").stat().st_size > 0
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["step_000004"]  # keep_last=1
    assert len(trainer.policy.saved) == 2  # steps 2 and 4


def test_no_weight_push_after_the_last_step(tmp_path):
    trainer = make_trainer(tmp_path)  # 4 steps: pushes after steps 1-3, none after step 4 (no rollout follows)
    trainer.run()
    assert len(trainer.policy.train_batches) == 4
    assert trainer.collector.engine.events == ["sleep", "wake_up", "synced"] * 3 + ["sleep"]


def test_resume_continues_with_the_same_prompts(tmp_path):
    full = make_trainer(tmp_path / "full")
    full.run()
    stopped = make_trainer(tmp_path / "cut", "trainer.max_steps=2")
    stopped.run()
    resumed = make_trainer(tmp_path / "cut", "resume=true")
    resumed.run()
    prompts = lambda engine: [call[0] for call in engine.calls]  # noqa: E731
    assert prompts(resumed.collector.engine) == prompts(full.collector.engine)[2:]
    seeds = [call[2].seed for call in resumed.collector.engine.calls]
    assert seeds == [3000, 4000]
    assert resumed.collector.engine.events[:2] == ["wake_up", "synced"]  # weights pushed right after loading
    lines = [json.loads(line) for line in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4]


def test_resume_skips_incomplete_checkpoints_with_a_warning(tmp_path, caplog):
    full = make_trainer(tmp_path / "full")
    full.run()
    stopped = make_trainer(tmp_path / "cut", "trainer.max_steps=2")
    stopped.run()
    root = tmp_path / "cut" / "checkpoints"
    (root / "step_000003").mkdir()
    (root / "step_000003" / "state.json").write_text("{}")  # a folder with one file is not a checkpoint
    with caplog.at_level(logging.WARNING, logger="gtpo_megatron.run_dir"):
        resumed = make_trainer(tmp_path / "cut", "resume=true")
        resumed.run()
    assert "step_000003 is not a complete checkpoint (no complete.json" in caplog.text
    prompts = lambda engine: [call[0] for call in engine.calls]  # noqa: E731
    assert prompts(resumed.collector.engine) == prompts(full.collector.engine)[2:]  # resumed from step 2


def test_sigterm_saves_after_the_current_step_and_stops(tmp_path):
    trainer = make_trainer(tmp_path, "checkpoint.every_n_steps=0")
    original = trainer.step

    def step_then_signal(step):
        metrics = original(step)
        if step == 1:
            os.kill(os.getpid(), __import__("signal").SIGTERM)
        return metrics

    trainer.step = step_then_signal
    trainer.run()
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["step_000001"]


def test_dynamic_sampling_resamples_until_groups_vary(tmp_path):
    trainer = make_trainer(tmp_path, "algorithm=dapo", engine=FakeEngine(uniform_rounds=1))
    metrics = trainer.step(1)
    assert metrics["rollout/num_rounds"] == 2.0
    seeds = [call[2].seed for call in trainer.collector.engine.calls]
    assert seeds == [1000, 1001]
    batch, loss, _ = trainer.policy.train_batches[0]
    assert batch.advantages.abs().min() > 0  # both chosen groups come from the varied second round
    assert loss.aggregation == "token-mean" and loss.clip_eps_high == 0.28


def test_removed_rows_reach_the_policy_as_a_loss_row_mask(tmp_path):
    trainer = make_trainer(tmp_path, "algorithm.skip_uniform_groups=true", engine=FakeEngine(uniform_rounds=1))
    for step in (1, 2):
        trainer.step(step)
    (uniform, _, _), (varied, _, _) = trainer.policy.train_batches
    assert uniform.loss_row_mask.tolist() == [False] * 8 and not uniform.loss_mask.any()  # the policy skips it
    assert varied.loss_row_mask.all() and torch.equal(varied.loss_mask, varied.response_mask)


class _RecordingEngine(FakeEngine):
    def generate(self, prompt_ids, n, sampling, prompt_indices=None):
        self.events.append("generate")
        return super().generate(prompt_ids, n, sampling, prompt_indices)


class _RecordingPolicy(FakePolicy):
    def compute_logprobs(self, batch, *, temperature=1.0, entropy_temperature=None):
        self.events.append("compute_logprobs")
        return super().compute_logprobs(batch, temperature=temperature, entropy_temperature=entropy_temperature)

    def train_step(self, batch, loss):
        self.events.append("train_step")
        return super().train_step(batch, loss)


def test_train_state_is_offloaded_around_the_rollout(tmp_path, monkeypatch):
    monkeypatch.setattr("gtpo_megatron.trainer._cuda_available", lambda: True)
    engine, policy = _RecordingEngine(), _RecordingPolicy()
    policy.events = engine.events  # one timeline for both
    trainer = make_trainer(tmp_path, "rollout.offload_train_state=true", engine=engine, policy=policy)
    trainer.step(1)
    trainer.step(2)
    rollout = ["offload_train_state", "generate", "sleep", "restore_train_state"]
    update = ["train_step", "wake_up", "synced"]
    # Step 1 of the paper filter measures <H>_ini in one pass before the update (log-probs at T=0.9 and entropy at
    # T=1 from one forward); step 2 needs no pass before the update.
    assert engine.events == rollout + ["compute_logprobs"] + update + rollout + update


def test_train_state_offload_is_off_by_default_and_warns_without_cuda(tmp_path, monkeypatch, caplog):
    policy = _RecordingPolicy()
    make_trainer(tmp_path, policy=policy).step(1)
    assert "offload_train_state" not in policy.events and "restore_train_state" not in policy.events
    monkeypatch.setattr("gtpo_megatron.trainer._cuda_available", lambda: False)
    policy = _RecordingPolicy()
    with caplog.at_level("WARNING"):
        trainer = make_trainer(tmp_path / "cpu", "rollout.offload_train_state=true", policy=policy)
    assert "rollout.offload_train_state=true has no effect without CUDA" in caplog.text
    trainer.step(1)
    assert "offload_train_state" not in policy.events


class _FailingRewardPool(FakeRewardPool):
    """A grader that times out on 3 answers of every 8."""

    def score(self, completions, references, *, extraction="strict"):
        results, stats = super().score(completions, references, extraction=extraction)
        return results, {**stats, "num_timeouts": 3, "errors": ["timeout after 5.0 s on '...\\boxed{9^{9^9}}'"]}


@pytest.mark.parametrize(("max_error_frac", "stops"), [(0.5, False), (0.25, True)])
def test_grader_failures_above_reward_max_error_frac_stop_the_step(tmp_path, max_error_frac, stops):
    trainer = make_trainer(tmp_path, f"reward.max_error_frac={max_error_frac}")
    trainer.collector.reward_pool = _FailingRewardPool()
    if stops:
        with pytest.raises(RuntimeError, match=r"reward 'fake' failed to grade 3 of 8 answers.*boxed"):
            trainer.step(1)
    else:
        assert trainer.step(1)["reward/num_timeouts"] == 3


def test_no_pass_before_the_update_once_initial_entropy_is_known(tmp_path):
    policy = _RecordingPolicy()
    trainer = make_trainer(tmp_path, "algorithm.initial_entropy_steps=2", policy=policy)
    first, second, third = trainer.step(1), trainer.step(2), trainer.step(3)
    # Steps 1-2 measure <H>_ini (one pass each, before the update), step 3 computes everything in its forward.
    assert policy.events == ["compute_logprobs", "train_step"] * 2 + ["train_step"]
    assert first["time/old_logprob_s"] > 0 and second["time/old_logprob_s"] > 0 and third["time/old_logprob_s"] == 0
    assert trainer.initial_entropy.steps == 2 and trainer.initial_entropy.value == pytest.approx(0.375)
    # the pass before the update feeds <H>_i to the loss; without it the loss measures <H>_i itself
    assert policy.train_batches[0][0].seq_entropy is not None and policy.train_batches[2][0].seq_entropy is None
    assert third["gtpo/filtered_frac"] == first["gtpo/filtered_frac"] == pytest.approx(2 / 8)
    assert third["entropy/completion_mean"] == first["entropy/completion_mean"]


def test_grpo_has_no_pass_before_the_update(tmp_path):
    policy = _RecordingPolicy()
    metrics = make_trainer(tmp_path, "algorithm=grpo", policy=policy).step(1)
    assert policy.events == ["train_step"] and metrics["time/old_logprob_s"] == 0.0
    assert metrics["gtpo/filtered_frac"] == 0.0 and "entropy/initial" not in metrics


class _ShiftedReference(_RecordingPolicy):
    """A reference whose log-probs are 0.5 nats below the fake policy's."""

    def compute_logprobs(self, batch, *, temperature=1.0, entropy_temperature=None):
        logprobs, entropy = super().compute_logprobs(batch, temperature=temperature)
        self.temperatures = (temperature, entropy_temperature)
        return logprobs - 0.5 * batch.response_mask, entropy


def test_kl_term_gets_reference_logprobs(tmp_path):
    with pytest.raises(ValueError, match="needs a reference policy exactly when it is > 0"):
        make_trainer(tmp_path, "algorithm=grpo", "algorithm.kl_coef=1e-6")
    reference, policy = _ShiftedReference(), _RecordingPolicy()
    trainer = make_trainer(tmp_path, "algorithm=grpo", "algorithm.kl_coef=1e-6", policy=policy, reference=reference)
    metrics = trainer.step(1)
    batch, loss, _ = policy.train_batches[0]
    assert reference.events == ["compute_logprobs"] and policy.events == ["train_step"]
    assert reference.temperatures == (0.9, None) and loss.kl_coef == 1e-6  # log-probs at the loss temperature
    torch.testing.assert_close(batch.ref_logprobs, torch.where(batch.response_mask, -1.5, 0.0))
    # k3 with log pi_ref - log pi = -0.5: exp(-0.5) + 0.5 - 1 per token (ops.losses)
    assert metrics["train/kl_mean"] == pytest.approx(math.exp(-0.5) - 0.5, rel=1e-6)
    assert metrics["time/ref_logprob_s"] > 0


def test_resume_refuses_to_measure_initial_entropy_on_a_trained_policy(tmp_path):
    make_trainer(tmp_path, "trainer.max_steps=2", "algorithm.entropy_filter=fixed").run()
    resumed = make_trainer(tmp_path, "resume=true")  # the paper filter, but the checkpoint has no <H>_ini
    with pytest.raises(ValueError, match=r"holds <H>_ini measured over 0 of the first.*trained policy"):
        resumed.run()
    # a run that measured <H>_ini over its first step resumes with it
    make_trainer(tmp_path / "paper", "trainer.max_steps=2").run()
    resumed = make_trainer(tmp_path / "paper", "resume=true")
    resumed.run()
    assert resumed.initial_entropy.value == pytest.approx(0.375) and resumed.initial_entropy.steps == 1
    # measuring over 3 steps: a checkpoint at step 2 (2 of 3 measured) resumes and measures step 3 as the
    # uninterrupted run would; asking for more steps than the checkpoint measured after them is refused
    make_trainer(tmp_path / "three", "trainer.max_steps=2", "algorithm.initial_entropy_steps=3").run()
    resumed = make_trainer(tmp_path / "three", "resume=true", "algorithm.initial_entropy_steps=3")
    resumed.run()
    assert resumed.initial_entropy.steps == 3
    with pytest.raises(ValueError, match="measured over 3 of the first algorithm.initial_entropy_steps=5"):
        make_trainer(
            tmp_path / "three", "resume=true", "trainer.max_steps=6", "algorithm.initial_entropy_steps=5"
        ).run()


class _RecordingTokenizer(FakeTokenizer):
    def __init__(self):
        self.texts = []

    def __call__(self, text, add_special_tokens=True):
        self.texts.append(text)
        return super().__call__(text, add_special_tokens=add_special_tokens)


def test_collector_prompts_use_the_configured_system_prompt(tmp_path):
    from gtpo_megatron.data import SYSTEM_PROMPTS

    trainer = make_trainer(tmp_path)
    trainer.collector.tokenizer = tokenizer = _RecordingTokenizer()
    trainer.collector.system_prompt = SYSTEM_PROMPTS["authors"]
    trainer.step(1)
    assert tokenizer.texts and all(t.startswith(SYSTEM_PROMPTS["authors"]) for t in tokenizer.texts)


def test_every_metric_consumer_reads_names_the_step_writes(tmp_path):
    """The renamed metrics (entropy/completion_mean, entropy/token_mean, ...) reach every consumer under one name."""
    from gtpo_megatron import logging as gtpo_logging
    from gtpo_megatron.evaluation.compare import METRICS

    metrics = make_trainer(tmp_path).step(1)
    consumers = {k for k, _ in gtpo_logging.PROGRESS_KEYS} | {k for k, _ in gtpo_logging.CURVES}
    consumers |= {k for k, _ in METRICS}
    assert consumers <= set(metrics), consumers - set(metrics)
    assert "entropy/mean" not in metrics and "train/entropy_mean" not in metrics  # the old, ambiguous names
    line = format_step_line(1, metrics)
    assert "entropy/completion_mean=0.375" in line and "gtpo/filtered_frac=0.25" in line


def test_off_policy_correction_reaches_the_loss_and_metrics(tmp_path):
    # The fake policy's log-probs are -1, the engine's -1 and -0.5 (half the tokens each): rho = 1 and exp(-0.5).
    trainer = make_trainer(tmp_path, "algorithm.off_policy_correction=tis", "algorithm.off_policy_cap=1.5")
    metrics = trainer.step(1)
    _, loss, _ = trainer.policy.train_batches[0]
    assert (loss.off_policy_correction, loss.off_policy_cap) == ("tis", 1.5)
    assert metrics["offpolicy/is_weight_mean"] == pytest.approx((1 + math.exp(-0.5)) / 2)
    assert metrics["offpolicy/is_capped_frac"] == 0.0 and metrics["offpolicy/is_undefined_frac"] == 0.0
    assert "offpolicy/is_weight_mean" not in make_trainer(tmp_path / "none").step(1)
