"""A 2-step ``Trainer.run`` on one GPU with NCCL: the whole loop, every collective on its group's device.

The real ``MegatronPolicy`` (``tests.gpu.common.MODEL``, bf16) and, when vLLM is not installed, the fake rollout
engine and reward pool of ``tests/trainer/fakes.py`` (the real vLLM engine and rewards when it is). Two steps, the
stop-flag agreement after each, a checkpoint save at the end. Run twice: on a pure NCCL default group, where any CPU
tensor reaching a collective crashes (the trainer's stop flag once did, at the end of step 1), and on
``cpu:gloo,cuda:nccl``, the default of ``init_distributed`` on GPU machines. Every ``torch.distributed`` collective is
recorded (``tests/helpers/collective_recorder.py``): the package's own must come from ``parallel/collectives.py`` or
the weight gather, with their tensors on the group's device. In a dry run: one run on gloo, on the CPU, with the
stand-in engine.
"""

from __future__ import annotations

import importlib.util
import json
import math
import time

import pytest

from tests.gpu.common import DRY_RUN, MODEL, needs_cuda, single_rank_world
from tests.gpu.report import record

pytestmark = pytest.mark.gpu
VLLM = not DRY_RUN and importlib.util.find_spec("vllm") is not None  # a dry run never starts vLLM


def _config(out_dir: str):
    from gtpo_megatron.config import load_config

    return load_config(None, [
        f"model={MODEL}", f"output_dir={out_dir}", f"model.params_dtype={'float32' if DRY_RUN else 'bfloat16'}",
        "rollout.num_prompts=2", "algorithm.group_size=4", "optim.micro_batch_size=4", "optim.lr=1e-4",
        "rollout.max_tokens=32", "rollout.max_prompt_len=256", "rollout.gpu_memory_utilization=0.3",
        "trainer.max_steps=2", "logging.wandb_mode=disabled", "logging.progress=false", "reward.num_workers=1",
    ])  # fmt: skip


def _trainer(cfg, groups):
    """The real trainer with vLLM when it is installed, else the real policy with the fake engine and rewards."""
    from gtpo_megatron.build import build_policy, build_trainer
    from gtpo_megatron.builtin_models import resolve_model_path
    from tests.trainer.fakes import fake_rollout_trainer

    if VLLM:
        return build_trainer(cfg, groups)
    policy = build_policy(cfg, resolve_model_path(cfg.model.name_or_path), groups)
    return fake_rollout_trainer(cfg, groups=groups, policy=policy)


@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl"])
def test_trainer_run_two_steps(backend: str, tmp_path) -> None:
    import torch.distributed as dist

    from tests.helpers.collective_recorder import CollectiveRecorder, violations

    if backend == "nccl":
        needs_cuda("a pure NCCL process group")
    cfg = _config(str(tmp_path / "run"))
    with single_rank_world(backend) as groups:
        trainer = _trainer(cfg, groups)
        start = time.perf_counter()
        with CollectiveRecorder() as recorder:
            trainer.run()
        seconds = time.perf_counter() - start
        trainer.close()
        actual_backend = str(dist.get_backend())
    check, label = "test_trainer_run_two_steps", f"{actual_backend}, {'vLLM' if VLLM else 'fake engine'}"
    package = [c for c in recorder.calls if c.origin == "package"]
    record(check, f"{label}: 2 steps + checkpoint", seconds, unit="s")
    record(check, f"{label}: collectives of the package", len(package))
    record(check, f"{label}: collectives of Megatron and torch", len(recorder.calls) - len(package))
    problems = violations(recorder.calls)
    assert problems == [], problems
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    assert all(math.isfinite(s["train/loss"]) and s["train/grad_norm"] > 0 for s in steps), steps
    assert (tmp_path / "run" / "checkpoints" / "step_000002").is_dir()
    record(check, f"{label}: step 2 grad norm", steps[-1]["train/grad_norm"])
