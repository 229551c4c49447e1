"""Dist checkpoints of a LoRA policy: the adapters only, exact resume, another layout, refused mismatches.

Run 1 (TP=2, ``model.lora`` rank 4 on all seven projections): one optimizer step, save, then two more steps and
the log-probs recorded. Run 2, fresh processes: the checkpoint holds adapter tensors only (its metadata); TP=2
resumes and the next two steps' loss / grad norm / lr and the log-probs are *identical*; PP=2 loads the same
checkpoint within fp32 noise; a policy without LoRA, or with another rank, is refused naming ``model.lora``.
"""

from __future__ import annotations

import pytest
import torch

from gtpo_megatron.config import LoRAConfig
from gtpo_megatron.ops import LossSpec
from tests.adapter.megatron_helpers import TINY_QWEN2, make_batch, model_section, settings_at
from tests.helpers.dist_harness import run_distributed

pytestmark = pytest.mark.distributed

LOSS = LossSpec(loss_name="gtpo", aggregation="seq-mean-token-mean", clip_eps_low=0.9, clip_eps_high=10.0)
RESHARD_ATOL = 1e-5
LORA = LoRAConfig(rank=4, alpha=8.0)


def _policy(tp: int, pp: int, lora: LoRAConfig | None = LORA):
    from gtpo_megatron.config import OptimConfig
    from gtpo_megatron.megatron_adapter.policy import MegatronPolicy
    from gtpo_megatron.parallel.groups import init_distributed

    groups = init_distributed(tp_size=tp, pp_size=pp)
    model = model_section(TINY_QWEN2, **({} if lora is None else {"lora": lora}))
    settings = settings_at(groups, model, optim=OptimConfig(lr=1e-2, clip_grad=1.0), micro_batch_size=2, seed=7)
    return MegatronPolicy.from_pretrained(settings, groups=groups)


def _batch():
    batch = make_batch(rows=4, seed=5)
    batch.old_logprobs = torch.full(batch.input_ids.shape, -10.8) * batch.response_mask
    return batch


def _continue(policy) -> dict:
    steps = [policy.train_step(_batch(), LOSS) for _ in range(2)]
    logprobs, _ = policy.compute_logprobs(_batch())
    return {"logprobs": logprobs, "steps": [(m["loss"], m["grad_norm"], m["lr"]) for m in steps]}


def _first_run(rank: int, world_size: int, root: str) -> None:
    policy = _policy(2, 1)
    assert policy.train_step(_batch(), LOSS)["skipped"] == 0.0
    policy.save_checkpoint(f"{root}/step_000001", {"step": 1})
    result = _continue(policy)
    if rank == 0:
        torch.save(result, f"{root}/expected.pt")


def _resume(rank: int, world_size: int, root: str) -> None:
    from megatron.core.dist_checkpointing import load_tensors_metadata

    keys = list(load_tensors_metadata(f"{root}/step_000001"))
    assert keys and all("_lora." in key for key in keys if key.startswith("decoder.")), keys
    assert not any("embedding" in key or key.endswith("linear_qkv.weight") for key in keys), keys
    expected = torch.load(f"{root}/expected.pt", weights_only=True)
    policy = _policy(2, 1)
    assert policy.load_checkpoint(root) == {"step": 1}
    resumed = _continue(policy)
    assert resumed["steps"] == expected["steps"], (resumed["steps"], expected["steps"])
    assert torch.equal(resumed["logprobs"], expected["logprobs"])
    policy = _policy(1, 2)
    policy.load_checkpoint(root)
    resharded = _continue(policy)
    for (loss, norm, lr), (want_loss, want_norm, want_lr) in zip(resharded["steps"], expected["steps"]):
        assert abs(loss - want_loss) <= RESHARD_ATOL and abs(norm - want_norm) <= RESHARD_ATOL and lr == want_lr
    torch.testing.assert_close(resharded["logprobs"], expected["logprobs"], atol=RESHARD_ATOL, rtol=0)
    with pytest.raises(ValueError, match="written with LoRA .*this run has full fine-tuning.*model.lora.rank=4"):
        _policy(2, 1, lora=None).load_checkpoint(root)
    with pytest.raises(ValueError, match="resume with model.lora.rank=4, alpha=8"):
        _policy(2, 1, lora=LoRAConfig(rank=8)).load_checkpoint(root)


def test_lora_checkpoint_resume(tmp_path):
    run_distributed(_first_run, 2, str(tmp_path))
    run_distributed(_resume, 2, str(tmp_path))
