"""Two nodes on this machine, through the real multi-node launch path: ``launch/submit.sbatch``.

Stand-in ``srun`` and ``scontrol`` on PATH: ``scontrol`` names the head ``127.0.0.1`` and ``srun --nodes=N`` runs
the script's per-node command N times at once, each as one node with node-local folders of its own: a built-in model
cache (``GTPO_CACHE_DIR``, holding only a link to SmolLM2, so each node builds ``builtin:tiny-qwen2`` once), weight
staging (``GTPO_STAGING_DIR``) and a ``TMPDIR`` as long as a cluster job's scratch can be (a unix socket under it
would not fit ``AF_UNIX``). Each node's torchrun joins the c10d rendezvous on the head with one rank; each rank
leads one CPU engine (``rollout.num_engines=2``, the default weight sync), data parallelism 2; the run folder is
shared.

Two nodes train 2 steps and checkpoint step 2, then a ``resume=true`` job trains step 3. One node with 2 ranks (the
same layout: 2 engines, dp 2) trains the 3 steps at once. Every step-level number that does not measure time must
agree: completions, rewards and losses exactly, gradient norms and log-prob gaps to fp32 rounding. About 6 minutes
on the idle 2-core machine (three jobs, two engine starts each), twice that when it is shared.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gtpo_megatron.builtin_models import missing_model_files, resolve_model_path
from gtpo_megatron.node_local import MAX_SOCKET_PATH
from tests.helpers.dist_harness import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
SRUN = """#!/usr/bin/env bash
# srun --nodes=N [options] CMD...: CMD once per node, at once, each node with its own folders under $FAKE_NODES;
# the first to fail stops the others (--kill-on-bad-exit).
nodes=1
while [[ "$1" == --* ]]; do case "$1" in --nodes=*) nodes="${1#--nodes=}" ;; esac; shift; done
pids=()
for ((node = 0; node < nodes; node++)); do
  home="$FAKE_NODES/node_$node"
  mkdir -p "$home/cache" "$home/shm" "$home/$TMP_TAIL"
  [ -e "$home/cache/smollm2-135m-instruct" ] || ln -s "$SMOLLM2" "$home/cache/smollm2-135m-instruct"
  SLURM_NODEID=$node SLURM_LOCALID=0 GTPO_CACHE_DIR="$home/cache" GTPO_STAGING_DIR="$home/shm" \\
    TMPDIR="$home/$TMP_TAIL" "$@" &
  pids+=($!)
done
for _ in "${pids[@]}"; do
  if ! wait -n; then kill "${pids[@]}" 2>/dev/null; wait; exit 1; fi
done
"""
SCONTROL = "#!/usr/bin/env bash\necho 127.0.0.1\n"
TMP_TAIL = "scratch/slurm-job-77/" + "t" * 40  # a long node-local TMPDIR
OVERRIDES = [
    "model=builtin:tiny-qwen2",
    "parallel.tp_size=1",
    "rollout.num_engines=2",
    "rollout.max_tokens=16",
    "rollout.dtype=float32",
    "rollout.num_prompts=2",
    "algorithm.group_size=4",
    "checkpoint.every_n_steps=2",
    "logging.progress=false",
    "logging.wandb_mode=disabled",
    "optim.max_tokens_per_micro_batch=400",
    "optim.packing=true",
]
UNTIMED_SKIP = ("time/", "perf/", "sync/")


def _submit(tmp: Path, nodes: int, ranks_per_node: int, out: Path, *overrides: str) -> str:
    """``sbatch --nodes=nodes launch/submit.sbatch`` with the stand-ins; returns the job's output."""
    bin_dir = tmp / "bin"
    if not bin_dir.exists():
        bin_dir.mkdir()
        for name, body in (("srun", SRUN), ("scontrol", SCONTROL)):
            (bin_dir / name).write_text(body)
            (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "LOG_", "MASTER_", "GPUS_"))}
    env.update(
        PATH=f"{bin_dir}:{Path(sys.executable).parent}:{env['PATH']}",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
        FAKE_NODES=str(tmp / "nodes"),
        TMP_TAIL=TMP_TAIL,
        SMOLLM2=resolve_model_path("builtin:smollm2-135m-instruct"),
        OMP_NUM_THREADS="1",  # torchrun's own choice for several ranks a node, so both layouts use one thread
        SLURM_SUBMIT_DIR=str(REPO),
        SLURM_NNODES=str(nodes),
        SLURM_JOB_ID="77",
        SLURM_JOB_NODELIST="fake[0-1]",
        GPUS_PER_NODE=str(ranks_per_node),
        MASTER_PORT=str(free_port()),
        LOG_DIR=str(out / "logs"),
    )
    cmd = ["bash", "launch/submit.sbatch", "configs/cpu_demo.yaml", *OVERRIDES, *overrides, f"output_dir={out}/run"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return proc.stdout + proc.stderr


def _steps(out: Path) -> list[dict]:
    records = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(UNTIMED_SKIP)} for r in records if "train/loss" in r]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    two_nodes, one_node = tmp_path_factory.mktemp("two_nodes"), tmp_path_factory.mktemp("one_node")
    assert len(str(two_nodes / "nodes" / "node_0" / TMP_TAIL)) + 37 > MAX_SOCKET_PATH  # really too long
    logs = [_submit(two_nodes, 2, 1, two_nodes, "trainer.max_steps=2")]
    logs.append(_submit(two_nodes, 2, 1, two_nodes, "trainer.max_steps=3", "resume=true"))
    _submit(one_node, 1, 2, one_node, "trainer.max_steps=3")
    return two_nodes, one_node, "\n".join(logs)


def test_each_node_writes_its_own_files_and_both_share_the_run_folder(jobs):
    two_nodes, _, log = jobs
    for node in (0, 1):
        home = two_nodes / "nodes" / f"node_{node}"
        assert missing_model_files(home / "cache" / "tiny-qwen2") == []  # built on this node
        assert not [p.name for p in (home / "cache").iterdir() if p.name.startswith(".tiny-qwen2-")]  # no leftover
        assert list((home / "shm").iterdir()) == []  # the engine's staging folder, removed at close
        assert (two_nodes / "logs" / f"node_{node}").is_dir()
    checkpoints = sorted(p.name for p in (two_nodes / "run" / "checkpoints").iterdir())
    assert checkpoints == ["latest", "step_000002", "step_000003"]  # step 2 by the first job, 3 at the resumed end
    assert "submit.sbatch: 2 nodes x 1 ranks" in log and "resumed from" in log and "(step 2)" in log


def test_two_nodes_with_a_resume_train_the_steps_of_one_node(jobs):
    two_nodes, one_node, _ = jobs
    two, one = _steps(two_nodes), _steps(one_node)
    assert [r["step"] for r in two] == [r["step"] for r in one] == [1, 2, 3]
    for a, b in zip(two, one, strict=True):
        assert a.keys() == b.keys()
        exact = ("train/loss", "reward/mean", "response/length_mean", "entropy/completion_mean")
        assert {k: a[k] for k in exact} == {k: b[k] for k in exact}
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6)
        assert a["rollout/num_engines"] == 2
