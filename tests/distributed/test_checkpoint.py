"""Dist checkpoints of ``MegatronPolicy``: exact resume and loading into another TP/PP layout.

Two separate 2-rank runs share one checkpoint root:
1. TP=2: one optimizer step, save (``step_000001``), then record the log-probs, a random draw and two more steps;
2. a truncated copy ``step_000002`` is named by ``latest`` (a newer incomplete checkpoint); fresh processes, TP=2:
   load the root, which skips the truncated copy (``run_dir`` completeness); the trainer state, log-probs, the
   random draw and the next two steps' loss / grad norm / lr must be *identical* (exact equality: same layout,
   same arithmetic); loading into Megatron's distributed optimizer fails with a clear RuntimeError on CPU (a
   megatron-core 0.16.1-0.19.2 limitation);
   then the same processes switch to PP=2 (a different layout) and load again: log-probs and the next two steps
   agree within fp32 noise (1e-5), which needs the model and the Adam state resharded correctly (the second step
   depends on both moments).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from gtpo_megatron import run_dir
from gtpo_megatron.ops import LossSpec
from tests.adapter.megatron_helpers import TINY_QWEN2, make_batch, model_section, settings_at
from tests.helpers.dist_harness import run_distributed

pytestmark = pytest.mark.distributed

LOSS = LossSpec(loss_name="gtpo", aggregation="seq-mean-token-mean", clip_eps_low=0.9, clip_eps_high=10.0)
RESHARD_ATOL = 1e-5  # same math, different TP/PP split: fp32 summation-order noise only


def _policy(tp: int, pp: int, distributed_optimizer: bool):
    from gtpo_megatron.config import OptimConfig
    from gtpo_megatron.megatron_adapter.policy import MegatronPolicy
    from gtpo_megatron.megatron_adapter.settings import LRSchedule
    from gtpo_megatron.parallel.groups import init_distributed

    groups = init_distributed(tp_size=tp, pp_size=pp)
    optim, schedule = (
        OptimConfig(lr=1e-3, warmup_steps=1, clip_grad=1.0),
        LRSchedule(total_steps=10, decay_style="cosine"),
    )
    settings = settings_at(groups, model_section(TINY_QWEN2), optim=optim, schedule=schedule, micro_batch_size=2,
                           seed=7, use_distributed_optimizer=distributed_optimizer)  # fmt: skip
    return MegatronPolicy.from_pretrained(settings, groups=groups)


def _batch():
    batch = make_batch(rows=4, seed=5)
    # fixed old log-probs (uniform over the vocabulary): the loss value then depends on the current weights
    batch.old_logprobs = torch.full(batch.input_ids.shape, -10.8) * batch.response_mask
    return batch


def _continue(policy) -> dict:
    batch = _batch()
    logprobs, _ = policy.compute_logprobs(batch)
    draw = torch.rand(4)
    steps = [policy.train_step(batch, LOSS) for _ in range(2)]
    return {"logprobs": logprobs, "draw": draw, "steps": [(m["loss"], m["grad_norm"], m["lr"]) for m in steps]}


def _first_run(rank: int, world_size: int, root: str) -> None:
    policy = _policy(2, 1, False)
    assert policy.train_step(_batch(), LOSS)["skipped"] == 0.0
    policy.save_checkpoint(f"{root}/step_000001", {"step": 1, "loader": {"epoch": 0, "position": 4}})
    if rank == 0:
        torch.save(_continue(policy), f"{root}/expected.pt")
    else:
        _continue(policy)


def _resume_same_layout(rank: int, world_size: int, root: str) -> None:
    from megatron.core.optimizer.distrib_optimizer import HAVE_APEX_OR_TE

    if not HAVE_APEX_OR_TE:  # megatron-core 0.16-0.19 cannot load into its distributed optimizer here: clear error
        with pytest.raises(RuntimeError, match="use_distributed_optimizer=False"):
            _policy(2, 1, True).load_checkpoint(root)
    policy = _policy(2, 1, False)
    assert policy.load_checkpoint(root) == {"step": 1, "loader": {"epoch": 0, "position": 4}}
    got, expected = _continue(policy), torch.load(f"{root}/expected.pt")
    assert torch.equal(got["logprobs"], expected["logprobs"])
    assert torch.equal(got["draw"], expected["draw"]), "RNG state was not restored"
    assert got["steps"] == expected["steps"], (got["steps"], expected["steps"])
    if rank == 0:
        print(f"[resume] next two steps (loss, grad_norm, lr): {got['steps']} == {expected['steps']}")


def _resume(rank: int, world_size: int, root: str) -> None:
    _resume_same_layout(rank, world_size, root)
    _resume_other_layout(rank, world_size, root)


def _resume_other_layout(rank: int, world_size: int, root: str) -> None:
    policy = _policy(1, 2, False)
    assert policy.load_checkpoint(f"{root}/step_000001")["step"] == 1
    got, expected = _continue(policy), torch.load(f"{root}/expected.pt")
    lp_diff = (got["logprobs"] - expected["logprobs"]).abs().max().item()
    assert lp_diff <= RESHARD_ATOL, lp_diff
    for (loss, norm, lr), (loss_ref, norm_ref, lr_ref) in zip(got["steps"], expected["steps"]):
        assert abs(loss - loss_ref) <= RESHARD_ATOL and abs(norm - norm_ref) <= 1e-4 * norm_ref, (loss, loss_ref)
        assert lr == lr_ref
    if rank == 0:
        print(f"[reshard TP=2 -> PP=2] |logprobs diff| = {lp_diff:.3e}; steps {got['steps']} vs {expected['steps']}")


def test_checkpoint_resume_is_exact_and_reshards(tmp_path):
    root = str(tmp_path / "checkpoints")
    run_distributed(_first_run, 2, root)
    assert (Path(root) / "latest").read_text() == "step_000001"
    assert sorted(p.name for p in Path(root).iterdir()) == ["expected.pt", "latest", "step_000001"]
    step = Path(root) / "step_000001"
    listed = json.loads((step / run_dir.COMPLETE_MARKER).read_text())["files"]
    # Megatron's files: sharded tensors, .metadata, metadata.json, and common.pt up to megatron-core 0.16 (0.17+
    # keeps the common state inside the torch_dist files)
    assert run_dir.checkpoint_problem(step) is None and {".metadata", "metadata.json"} <= set(listed)
    assert any(name.endswith(".distcp") for name in listed)
    truncated = Path(root) / "step_000002"  # a newer copy that lost the end of its largest shard
    shutil.copytree(step, truncated)
    largest = max(listed, key=listed.get)
    with open(truncated / largest, "r+b") as handle:
        handle.truncate(listed[largest] // 2)
    (Path(root) / "latest").write_text("step_000002")
    run_distributed(_resume, 2, root)  # fresh processes: nothing survives from the first run but the files


def _bf16_round_trip(rank: int, world_size: int, root: str) -> None:
    from gtpo_megatron.config import OptimConfig
    from gtpo_megatron.megatron_adapter.policy import MegatronPolicy
    from gtpo_megatron.megatron_adapter.settings import LRSchedule
    from gtpo_megatron.parallel.groups import init_distributed

    groups = init_distributed(tp_size=1, pp_size=1)
    model = model_section(TINY_QWEN2, params_dtype="bfloat16")
    optim, schedule = OptimConfig(lr=1e-3, clip_grad=1.0), LRSchedule(total_steps=10)
    settings = settings_at(groups, model, optim=optim, schedule=schedule, micro_batch_size=2, seed=7)
    policy = MegatronPolicy.from_pretrained(settings, groups=groups)
    assert {p.dtype for p in policy.model.parameters()} == {torch.bfloat16}  # the local spec's RMSNorms included
    policy.train_step(_batch(), LOSS)
    policy.save_checkpoint(f"{root}/step_000001", {"step": 1})
    expected, _ = policy.compute_logprobs(_batch())
    reloaded = MegatronPolicy.from_pretrained(settings, groups=groups)
    assert reloaded.load_checkpoint(root)["step"] == 1
    assert torch.equal(reloaded.compute_logprobs(_batch())[0], expected)


def test_checkpoint_bf16_params_round_trip(tmp_path):
    """bf16 parameters: Megatron's 16-bit optimizer maps every parameter in its sharded state (found on an H200:
    the local spec's fp32 RMSNorms made the save fail with "Param id ... does not match any model sharded param")."""
    run_distributed(_bf16_round_trip, 1, str(tmp_path / "checkpoints"))
