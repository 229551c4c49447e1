"""LoRA end to end: ``gtpo-train`` with ``model.lora.rank=4`` at TP=2 (gloo), the real vLLM engine on CPU, 2 steps.

After step 1's update the merged weights (``W + alpha / rank * B @ A``, each TP rank sending its merged shards: the
default sharded sync) go to the engine, which samples step 2:
its log-probs must still match the trainer's (``mismatch/abs_logprob_diff``), with a learning rate large enough
(1e-2) that the adapters move the log-probs past that tolerance if the merge were wrong (0.09 with the adapters
left out of the sync, 0.0015 merged). The checkpoints hold the adapters. With ``rollout.lora_sync=adapter`` the
engine keeps its base weights and serves the adapters (a PEFT folder under a new LoRA id): the same bound holds
(0.0017; 0.093 with generation requests not carrying the adapter), and the sync moves only the adapters' bytes
(``sync/bytes``: 65,536 bytes of fp32 adapters against 25,757,952 merged in the engine's bf16 here).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_train_loop import REPO, _free_port

pytestmark = pytest.mark.integration


ADAPTER_BYTES = 2 * 4 * 4 * (256 + 192 + 192 + 256 + 384 + 384 + 384)
"""Float32 ``A`` and ``B`` of rank 4 on tiny-qwen2's 2 layers: ``rank * (in + out)`` per projection (hidden 128,
KV 64, MLP 256: q 256, k 192, v 192, o 256, gate 384, up 384, down 384)."""


@pytest.mark.parametrize("lora_sync", ["merged", "adapter"])
def test_lora_trains_and_keeps_engine_in_sync(tmp_path, lora_sync):
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [
        str(torchrun), "--nproc_per_node=2", f"--master_port={_free_port()}", "-m", "gtpo_megatron.train",
        "--config", str(REPO / "configs" / "cpu_demo.yaml"), "model=builtin:tiny-qwen2", "parallel.tp_size=2",
        "trainer.max_steps=2", "rollout.max_tokens=16", "algorithm.group_size=4", "checkpoint.every_n_steps=1",
        "model.lora.rank=4", "model.lora.alpha=8", "optim.lr=1e-2", f"output_dir={tmp_path}",
        f"rollout.lora_sync={lora_sync}",
    ]  # fmt: skip
    env = {**os.environ, "WANDB_MODE": "offline"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["sync/num_tensors"] > 0 and records[0]["sync/megabytes"] > 0
    for record in records:
        assert record["train/grad_norm"] > 0
        assert record["mismatch/abs_logprob_diff"] < 0.02, record["mismatch/abs_logprob_diff"]  # 0.09 unmerged
    print({key: [r.get(key) for r in records] for key in ("mismatch/abs_logprob_diff", "sync/bytes", "loss")})
    assert (records[0]["sync/bytes"] == ADAPTER_BYTES) == (lora_sync == "adapter"), records[0]["sync/bytes"]
    assert (tmp_path / "checkpoints" / "step_000002").is_dir()
    sharded = "weight sync: rollout.weight_sync=sharded (auto)" in proc.stdout + proc.stderr
    assert sharded == (lora_sync == "merged")  # merged shards sent by both TP ranks
