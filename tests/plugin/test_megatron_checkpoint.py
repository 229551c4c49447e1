"""A Megatron-LM-style checkpoint as the starting policy (``model.megatron_checkpoint``), at another TP/PP layout.

1. Two gloo ranks at TP=2 build a GPTModel with Megatron-Core's own API (the example's ``model_provider``; random
   init, vocabulary padded to 49,408 rows as another trainer's padding rule might). They record the float64
   log-probs of a fixed group of completions, the full embedding and one MLP weight, and write
   ``{"model": sharded_state_dict, "args": Namespace, ...}`` with ``megatron.core.dist_checkpointing.save`` into
   ``iter_0000003/`` next to ``latest_checkpointed_iteration.txt``, as Megatron-LM does. With megatron-core 0.16 its
   ``common.pt`` (pickled args) is then overwritten with garbage: the weights-only loader must never open it (0.17+
   store the common state inside the torch_dist files, and the loader skips it the same way).
2. Two fresh ranks at TP=1, PP=2 build the policy from the config (``build.build_policy``): its log-probs equal the
   recorded ones; a one-step run (``Trainer`` with a fake engine returning that group with the recorded log-probs as
   its rollout log-probs) first pushes the loaded weights to the engine (bit-equal to the recorded tensors), then
   reports a train/rollout mismatch of ~0: the first step's log-probs are the saved weights'.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from gtpo_megatron.megatron_adapter.validation import validate_config
from gtpo_megatron.rollout.types import Completion, PromptCompletions
from tests.helpers.dist_harness import run_distributed
from tests.helpers.references import ref_logprobs_entropy
from tests.trainer.fakes import FakeRewardPool, FakeTokenizer

pytestmark = pytest.mark.distributed

VOCAB, PADDED_VOCAB, ITERATION = 49152, 49408, 3
LOGPROB_ATOL = 1e-5  # fp32 model at two layouts vs a float64 log-softmax of the TP=2 fp32 logits


def _group() -> PromptCompletions:
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, VOCAB, (5,), generator=gen).tolist()
    completions = [
        Completion(token_ids=torch.randint(3, VOCAB, (n,), generator=gen).tolist() + [2], rollout_logprobs=[],
                   text="9" if j % 2 == 0 else "0", finish_reason="stop")
        for j, n in enumerate((6, 3, 5, 8))
    ]  # fmt: skip
    return PromptCompletions(prompt_ids=prompt, completions=completions)


def _core_api_model(hf_config, tp_size: int):
    """The writer's model: the example's own provider (Megatron-Core's API, local spec), random weights."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from examples.megatron_core_loop import model_provider
    from gtpo_megatron.megatron_adapter.cpu_compat import cuda_to_cpu_mode

    with cuda_to_cpu_mode():
        model_parallel_cuda_manual_seed(11)
        return model_provider(hf_config, tp_size=tp_size, padded_vocab_size=PADDED_VOCAB)


def _gather(tensor: torch.Tensor, group, dim: int) -> torch.Tensor:
    import torch.distributed as dist

    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _write_checkpoint(rank: int, world_size: int, root: str) -> None:
    from megatron.core import dist_checkpointing
    from transformers import AutoConfig

    from gtpo_megatron.builtin_models import resolve_model_path
    from gtpo_megatron.megatron_adapter.cpu_compat import cuda_to_cpu_mode
    from gtpo_megatron.parallel.groups import init_distributed
    from gtpo_megatron.rollout.batch import collate_completions

    groups = init_distributed(tp_size=2, pp_size=1)
    hf_config = AutoConfig.from_pretrained(resolve_model_path("builtin:tiny-llama"))
    model = _core_api_model(hf_config, tp_size=2)
    batch = collate_completions([_group()], pad_token_id=2)
    seq_len = batch.input_ids.shape[1]
    causal = torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad(), cuda_to_cpu_mode():
        logits = model(batch.input_ids, torch.arange(seq_len).expand(4, -1), causal)  # [4, S, V/2]
    full = _gather(logits, groups.tp, dim=-1)
    logprobs, _ = ref_logprobs_entropy(full[:, :-1], batch.input_ids[:, 1:], vocab_size=VOCAB)
    expected = torch.nn.functional.pad(logprobs, (1, 0)) * batch.response_mask
    embedding = _gather(model.embedding.word_embeddings.weight.detach(), groups.tp, dim=0)[:VOCAB]
    down_proj = _gather(model.decoder.layers[1].mlp.linear_fc2.weight.detach(), groups.tp, dim=1)
    folder = Path(root) / f"iter_{ITERATION:07d}"
    if rank == 0:
        folder.mkdir(parents=True)
    torch.distributed.barrier()
    state = {"model": model.sharded_state_dict(), "iteration": ITERATION, "checkpoint_version": 3.0,
             "args": argparse.Namespace(tensor_model_parallel_size=2, ckpt_format="torch_dist")}  # fmt: skip
    with cuda_to_cpu_mode():
        dist_checkpointing.save(state, str(folder))
    if rank == 0:
        (Path(root) / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
        weights = {"model.embed_tokens.weight": embedding, "model.layers.1.mlp.down_proj.weight": down_proj}
        torch.save({"logprobs": expected, "weights": weights}, Path(root) / "expected.pt")


class _ReplayEngine:
    """Returns the recorded group (rollout log-probs = the saved weights' log-probs); records calls and the tensors
    of the first push (the weights the engine starts from; the step's update changes later pushes)."""

    def __init__(self, expected_logprobs: torch.Tensor, response_mask: torch.Tensor):
        self.group = _group()
        for row, completion in enumerate(self.group.completions):
            completion.rollout_logprobs = expected_logprobs[row][response_mask[row]].tolist()
        self.events: list[str] = []
        self.tensors: dict[str, torch.Tensor] = {}

    def generate(self, prompt_ids, n, sampling, prompt_indices=None):
        assert n == 4
        self.events.append("generate")
        return [self.group]

    def begin_weight_update(self):
        self.events.append("push")

    def load_weight_bucket(self, bucket):
        if self.events.count("push") == 1:
            self.tensors.update({name: t.clone() for name, t in bucket})

    def finish_weight_update(self):
        pass

    def sleep(self):
        pass

    def wake_up(self):
        pass

    def close(self):
        pass


def _start_run(rank: int, world_size: int, root: str, output_dir: str) -> None:
    from gtpo_megatron.build import build_policy
    from gtpo_megatron.builtin_models import resolve_model_path
    from gtpo_megatron.config import config_to_dict, load_config
    from gtpo_megatron.data.datasets import load_problems
    from gtpo_megatron.data.loader import PromptLoader
    from gtpo_megatron.logging import MetricSink
    from gtpo_megatron.parallel.groups import init_distributed
    from gtpo_megatron.rollout.batch import collate_completions
    from gtpo_megatron.rollout.collector import RolloutCollector
    from gtpo_megatron.rollout.exchange import StepExchange
    from gtpo_megatron.trainer import Trainer

    cfg = load_config(None, [
        "model=builtin:tiny-llama", f"model.megatron_checkpoint={root}", "model.params_dtype=float32",
        "parallel.pp_size=2", "rollout.temperature=1.0", "rollout.num_prompts=1", "algorithm.group_size=4",
        "trainer.max_steps=1", "checkpoint.every_n_steps=0", "logging.wandb_mode=disabled", "logging.progress=false",
        f"output_dir={output_dir}",
    ])  # fmt: skip
    validate_config(cfg, world_size)
    groups = init_distributed(tp_size=1, pp_size=2)
    policy = build_policy(cfg, resolve_model_path(cfg.model.name_or_path), groups)
    assert policy.geometry.padded_vocab_size == PADDED_VOCAB  # read from the checkpoint, not 49,152
    expected = torch.load(Path(root) / "expected.pt")
    batch = collate_completions([_group()], pad_token_id=2)
    logprobs, _ = policy.compute_logprobs(batch)
    diff = (logprobs.double() - expected["logprobs"]).abs().max().item()
    assert diff <= LOGPROB_ATOL, f"loaded policy's log-probs differ from the saved weights' by {diff}"
    engine = _ReplayEngine(expected["logprobs"], batch.response_mask) if rank == 0 else None
    collector, exchange = None, StepExchange.from_config(cfg, num_engines=1, group=torch.distributed.group.WORLD)
    if rank == 0:
        collector = RolloutCollector(engine=engine, reward_pool=FakeRewardPool(), tokenizer=FakeTokenizer(),
                                     exchange=exchange, extraction="lenient")  # fmt: skip
    sink = MetricSink(output_dir, cfg=cfg.logging, run_config=config_to_dict(cfg), max_steps=1, start_step=0,
                      enabled=rank == 0)  # fmt: skip
    loader = PromptLoader(load_problems("synthetic", limit=8), batch_size=1, seed=0)
    trainer = Trainer(cfg, groups=groups, policy=policy, collector=collector, loader=loader, exchange=exchange,
                      pad_token_id=2, sink=sink)  # fmt: skip
    trainer.run()
    trainer.close()
    if rank == 0:
        assert engine.events[:2] == ["push", "generate"], engine.events  # the engine starts from the loaded weights
        for name, tensor in expected["weights"].items():
            assert torch.equal(engine.tensors[name], tensor), name
        print(f"[megatron checkpoint TP=2 -> TP=1 PP=2] max |log-prob diff| = {diff:.3e}")


def test_run_starts_from_a_megatron_lm_checkpoint_at_another_layout(tmp_path):
    root, output_dir = str(tmp_path / "megatron_lm_run"), str(tmp_path / "run")
    run_distributed(_write_checkpoint, 2, root)
    folder = Path(root) / f"iter_{ITERATION:07d}"
    assert (folder / "metadata.json").is_file()
    if (folder / "common.pt").is_file():  # megatron-core 0.16; 0.17+ keep the common state inside torch_dist
        (folder / "common.pt").write_bytes(b"not a pickle")  # the weights-only loader must never open it
    run_distributed(_start_run, 2, root, output_dir)
    record = json.loads((Path(output_dir) / "metrics.jsonl").read_text().splitlines()[0])
    assert record["mismatch/abs_logprob_diff"] < LOGPROB_ATOL, record["mismatch/abs_logprob_diff"]
    assert record["train/grad_norm"] > 0
