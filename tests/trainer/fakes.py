"""Small stand-ins for the policy, engine, reward pool and tokenizer (the loop's own logic is what is tested), and
``fake_rollout_trainer``: a ``Trainer`` whose rollouts come from them, around any policy (a fake or the real one),
and ``make_trainer``: one over the fake policy too, in a one-process gloo world (``one_rank_process_group``)."""

from __future__ import annotations

import json
import os
import random
import socket
from pathlib import Path

import torch
import torch.distributed as dist

from gtpo_megatron.config import GTPOConfig, LoggingConfig, load_config
from gtpo_megatron.data.datasets import load_problems
from gtpo_megatron.data.loader import PromptLoader
from gtpo_megatron.logging import MetricSink
from gtpo_megatron.ops import compute_normalizer, policy_objective
from gtpo_megatron.rewards.registry import RewardResult
from gtpo_megatron.rollout.collector import RolloutCollector
from gtpo_megatron.rollout.exchange import StepExchange
from gtpo_megatron.rollout.types import Completion, PromptCompletions
from gtpo_megatron.run_dir import list_checkpoints, mark_complete
from gtpo_megatron.trainer import Trainer

EOS = 2


class FakeTokenizer:
    """No chat template: ``build_prompt_ids`` uses the plain template; ids are the first characters' codes."""

    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [3 + ord(ch) % 50 for ch in text[-6:]]}


class FakeEngine:
    """Completion j of a prompt is ``[10 + j % 3, EOS]``; its text is ``"9"`` when j is even, else ``"0"``.

    ``uniform_rounds``: the first that many ``generate`` calls return the same text for every completion.
    ``name`` and ``unusable`` are ``GuardedEngine``'s (the trainer's engine is used unguarded here).
    """

    name, unusable = "the fake engine", None

    def __init__(self, uniform_rounds: int = 0):
        self.calls: list[tuple[list[list[int]], int, object]] = []
        self.uniform_rounds = uniform_rounds
        self.pushed: list[list[str]] = []
        self.events: list[str] = []
        self.prompt_indices: list[list[int] | None] = []

    def generate(self, prompt_ids, n, sampling, prompt_indices=None):
        self.calls.append(([list(p) for p in prompt_ids], n, sampling))
        self.prompt_indices.append(list(prompt_indices) if prompt_indices is not None else None)
        uniform = len(self.calls) <= self.uniform_rounds
        return [
            PromptCompletions(
                prompt_ids=list(p),
                completions=[
                    Completion(
                        token_ids=[10 + j % 3, EOS],
                        rollout_logprobs=[-1.0, -0.5],
                        text="9" if (j % 2 == 0 or uniform) else "0",
                        finish_reason="stop",
                    )
                    for j in range(n)
                ],
            )
            for p in prompt_ids
        ]

    def begin_weight_update(self):
        self.pushed.append([])

    def load_weight_bucket(self, bucket):
        self.pushed[-1] += [name for name, _ in bucket]

    def finish_weight_update(self):
        self.events.append("synced")

    def sleep(self):
        self.events.append("sleep")

    def wake_up(self):
        self.events.append("wake_up")

    def close(self):
        self.events.append("close")


class FakeRewardPool:
    """Score 1.0 when the text equals the last character of the reference... i.e. correct iff text == "9"."""

    def score(self, completions, references, *, extraction="strict"):
        results = [
            RewardResult(score=float(c == "9"), correct=c == "9", format_ok=False, extracted=c) for c in completions
        ]
        stats = {"reward": "fake", "num_scored": len(completions), "num_timeouts": 0, "num_errors": 0, "errors": []}
        return results, {**stats, "seconds": 0.0}

    def close(self):
        pass


def _fake_logprobs_entropy(batch):
    mask = batch.response_mask
    rows = torch.arange(mask.shape[0], dtype=torch.float32).unsqueeze(-1)
    entropy = torch.where(mask, 0.25 * (rows % 4), 0.0)
    return torch.where(mask, -1.0, 0.0), entropy


class FakePolicy:
    """Log-probs -1.0 on response tokens; entropy 0.25 * (row % 4); records train batches; JSON checkpoints.

    ``train_step`` evaluates the real objective (``ops.policy_objective``) on those values, as the training forward
    of ``MegatronPolicy`` does, and returns its metric sums (plus fixed loss/grad-norm/lr values).
    """

    def __init__(self):
        self.train_batches = []
        self.saved: list[str] = []
        self.events: list[str] = []

    def offload_train_state(self):
        self.events.append("offload_train_state")

    def restore_train_state(self):
        self.events.append("restore_train_state")

    def compute_logprobs(self, batch, *, temperature=1.0, entropy_temperature=None):
        return _fake_logprobs_entropy(batch)

    def train_step(self, batch, loss):
        logprobs, entropy = _fake_logprobs_entropy(batch)
        normalizer = compute_normalizer(batch.loss_mask, loss.aggregation)
        _, sums, terms = policy_objective(logprobs, entropy, batch, loss, normalizer)
        self.train_batches.append((batch, loss, terms))
        metrics = {k: float(v) for k, v in sums.items()}
        kl_mean = metrics["kl_sum"] / max(metrics["num_tokens"], 1.0)
        return {**metrics, "loss": 0.5, "grad_norm": 1.0, "lr": 1e-5, "clip_frac": 0.0, "kl_mean": kl_mean}

    def iter_hf_weights(self):
        yield "model.embed_tokens.weight", torch.zeros(2, 2)
        yield "lm_head.weight", torch.zeros(2, 2)

    def save_checkpoint(self, path, trainer_state):
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "state.json").write_text(json.dumps(trainer_state))
        mark_complete(path)
        self.saved.append(path)

    def load_checkpoint(self, path):
        return json.loads((Path(path) / "state.json").read_text())


def single_rank_groups():
    """The ``ParallelGroups`` of a one-process world without Megatron's groups (every group None: size 1)."""
    from gtpo_megatron.parallel.groups import ParallelGroups

    return ParallelGroups(
        tp=None, pp=None, dp=None, mp=None, ep=None, tp_size=1, pp_size=1, dp_size=1, ep_size=1, world_size=1,
        tp_rank=0, pp_rank=0, dp_rank=0, ep_rank=0, rank=0, pp_first_global_rank=0, pp_last_global_rank=0,
        backend="gloo",
    )  # fmt: skip


def one_rank_process_group():
    """A one-process gloo world for the trainer's collectives (use as a module-scoped autouse fixture)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def make_trainer(tmp_path, *overrides, engine=None, policy=None, reference=None):
    """A ``Trainer`` over the fakes: 2 synthetic prompts x 4 completions per step, 4 steps, a save every 2."""
    cfg = load_config(
        None,
        [
            "model=builtin:tiny-qwen2",
            f"output_dir={tmp_path}",
            "rollout.num_prompts=2",
            "algorithm.group_size=4",
            "trainer.max_steps=4",
            "checkpoint.every_n_steps=2",
            "checkpoint.keep_last=1",
            "logging.wandb_mode=disabled",
            "logging.progress=false",
            *overrides,
        ],
    )
    start = max([int(p.name[5:]) for p in list_checkpoints(tmp_path / "checkpoints")] + [0]) if cfg.resume else 0
    return fake_rollout_trainer(
        cfg,
        groups=single_rank_groups(),
        policy=policy or FakePolicy(),
        engine=engine,
        start_step=start,
        reference=reference,
    )


def fake_collector(
    cfg: GTPOConfig, engine, *, extraction: str = "lenient", exchange: StepExchange | None = None, **fields
) -> RolloutCollector:
    """A ``RolloutCollector`` of ``engine`` with ``FakeRewardPool`` and ``FakeTokenizer`` and ``exchange`` (default:
    ``cfg``'s sections, one engine, one process); ``fields``: further constructor arguments (``engine_index``, ...)."""
    return RolloutCollector(
        engine=engine,
        reward_pool=FakeRewardPool(),
        tokenizer=FakeTokenizer(),
        exchange=exchange or StepExchange.from_config(cfg, num_engines=1, group=None),
        extraction=extraction,
        **fields,
    )


def fake_rollout_trainer(
    cfg: GTPOConfig, *, groups, policy, engine=None, start_step: int = 0, reference=None
) -> Trainer:
    """A ``Trainer`` of ``policy`` whose global rank 0 samples with ``engine`` (default ``FakeEngine()``) and scores
    with ``FakeRewardPool`` on synthetic prompts (``FakeTokenizer``); metrics go to ``cfg.output_dir`` without wandb or
    a progress bar. ``start_step``: the step a resumed run continues from (the sink drops later records);
    ``reference``: the KL reference policy, if any."""
    collector = None
    loader = PromptLoader(load_problems("synthetic", limit=50), batch_size=cfg.rollout.num_prompts, seed=0)
    exchange = StepExchange.from_config(cfg, num_engines=1, group=dist.group.WORLD)
    if groups.rank == 0:
        collector = fake_collector(cfg, engine or FakeEngine(), extraction="strict", exchange=exchange)
    sink = MetricSink(
        cfg.output_dir,
        cfg=LoggingConfig(wandb_mode="disabled", progress=False),
        run_config={},
        max_steps=cfg.trainer.max_steps,
        start_step=start_step,
        enabled=groups.rank == 0,
    )
    return Trainer(
        cfg,
        groups=groups,
        policy=policy,
        collector=collector,
        loader=loader,
        exchange=exchange,
        pad_token_id=0,
        sink=sink,
        reference=reference,
    )


class SeededFakeEngine(FakeEngine):
    """Completions that depend only on (call seed, GLOBAL prompt index, sample), like ``VLLMEngine``'s seeds.

    Sample j of the prompt at global index i: 1 to ``max_tokens`` tokens (the last one EOS unless it hit the limit),
    text ``"9"`` or ``"0"``; with ``uniform_scores`` every text is ``"0"`` (all answers equally wrong) while the
    lengths still differ.
    """

    def __init__(self, uniform_scores: bool = False):
        super().__init__()
        self.uniform_scores = uniform_scores

    def generate(self, prompt_ids, n, sampling, prompt_indices=None):
        self.calls.append(([list(p) for p in prompt_ids], n, sampling))
        indices = list(prompt_indices) if prompt_indices is not None else list(range(len(prompt_ids)))
        self.prompt_indices.append(indices)
        return [
            PromptCompletions(prompt_ids=list(p), completions=[self._sample(sampling, i, j) for j in range(n)])
            for p, i in zip(prompt_ids, indices)
        ]

    def _sample(self, sampling, index, sample):
        rng = random.Random(f"{sampling.seed}/{index}/{sample}")
        length = rng.randint(1, sampling.max_tokens)
        tokens = [rng.randint(3, 99) for _ in range(length)]
        finish = "length" if length == sampling.max_tokens else "stop"
        if finish == "stop":
            tokens[-1] = EOS
        text = "0" if self.uniform_scores else rng.choice("90")
        return Completion(tokens, [-rng.random() for _ in tokens], text, finish)
