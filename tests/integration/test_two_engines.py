"""Two vLLM engines in a real 2-rank job: ``torchrun --nproc_per_node=2`` with data parallelism 2 (tp_size=1),
``rollout.num_engines=2`` (ranks 0 and 1 lead one engine each, bound to their own CPU core) and the default weight
sync (``auto``: sharded on CPU, the two data-parallel replicas sharing the sending to both engines' workers), on
``builtin:tiny-qwen2`` in fp32, training on packed token-budget micro-batches (the rows dealt to the two
data-parallel ranks by tokens).

The default test runs 2 steps (about 2 minutes on the idle 2-core machine, mostly imports and two engine starts).
The ``slow`` test runs the same job with one engine and checks that every step-level number that does not measure
time is identical: the same completions, rewards, losses and gradient norms, and after the first update the same
second step (so the updates were the same too).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
OVERRIDES = [
    "model=builtin:tiny-qwen2",
    "parallel.tp_size=1",
    "trainer.max_steps=2",
    "rollout.max_tokens=16",
    "rollout.dtype=float32",
    "rollout.num_prompts=2",
    "algorithm.group_size=4",
    "checkpoint.every_n_steps=0",
    "logging.progress=false",
    "optim.max_tokens_per_micro_batch=400",
    "optim.packing=true",
]
PER_ENGINE = ("rollout/num_engines", "rollout/tokens_per_engine_min", "rollout/tokens_per_engine_max")


def _run(out: Path, *extra: str) -> tuple[list[dict], str]:
    from tests.helpers.dist_harness import free_port

    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nproc_per_node=2", f"--master_port={free_port()}", "-m", "gtpo_megatron.train",
           "--config", str(REPO / "configs" / "cpu_demo.yaml"), *OVERRIDES, *extra, f"output_dir={out}"]  # fmt: skip
    env = {**os.environ, "WANDB_MODE": "offline"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return records, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def two_engines(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("two"), "rollout.num_engines=2")


@pytest.mark.slow
def test_each_engine_generates_its_half_and_follows_the_default_sync(two_engines):
    records, log = two_engines
    assert log.count("weight sync: rollout.weight_sync=sharded (auto)") == 1  # resolved and logged once
    assert records[0]["sync/num_senders"] == 2  # both data-parallel replicas share the sending
    # rank 0's engine on core 0 (the other ranks log warnings only); engine 1's share shows in the token counters
    assert "started engine 0 of 2" in log and "{'VLLM_CPU_OMP_THREADS_BIND': '0'}" in log
    # no push after the last step
    assert [("sync/num_tensors" in r, "sync/gbytes_per_s" in r) for r in records] == [(True, True)] + [(False, False)]
    for record in records:
        assert record["rollout/num_engines"] == 2
        low, high = record["rollout/tokens_per_engine_min"], record["rollout/tokens_per_engine_max"]
        # one group of 4 completions each: together every response token of the 8-sequence batch
        assert low > 0 and low + high == pytest.approx(record["response/length_mean"] * 8)
        assert record.get("sync/num_tensors", 1) > 0 and record.get("sync/gbytes_per_s", 1) > 0
        # both engines sample with the trainer's weights (fp32 on both sides); step 2 after a sharded update;
        # the trainer's log-probs come from packed rows
        assert record["mismatch/abs_logprob_diff"] < 1e-3
        # 4 sequences a rank of at most 256 + 16 tokens: 1 or 2 packed rows of <= 400 tokens, no padding
        assert 1 <= record["perf/micro_batches"] <= 2 and record["perf/tokens_per_micro_batch_max"] <= 400
        assert record["perf/padding_frac"] == 0.0


@pytest.mark.slow
def test_one_and_two_engines_train_the_same_steps(two_engines, tmp_path):
    one, _ = _run(tmp_path / "one", "rollout.num_engines=1")
    two, _ = two_engines

    def untimed(record):
        return {
            k: v for k, v in record.items() if not k.startswith(("time/", "perf/", "sync/")) and k not in PER_ENGINE
        }

    assert [untimed(r) for r in one] == [untimed(r) for r in two]
