"""Launch scripts: the command lines they build, with torchrun / srun / scontrol replaced by recorders on PATH."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RECORDER = """#!/usr/bin/env bash
# Appends one line per call: the program name, then every argument shell-quoted.
printf '%s' "$(basename "$0")" >> "$RECORD"
for a in "$@"; do printf ' %q' "$a" >> "$RECORD"; done
printf '\\n' >> "$RECORD"
"""
# srun runs its command once per node here (2 nodes), like Slurm would, with SLURM_NODEID set.
SRUN = """#!/usr/bin/env bash
printf 'srun' >> "$RECORD"; for a in "$@"; do printf ' %q' "$a" >> "$RECORD"; done; printf '\\n' >> "$RECORD"
while [[ "$1" == --* ]]; do shift; done
for node in 0 1; do SLURM_NODEID=$node "$@"; done
"""
SCONTROL = """#!/usr/bin/env bash
printf 'gpu-node-07\\ngpu-node-08\\n'
"""


def _fake_bin(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("torchrun", RECORDER), ("srun", SRUN), ("scontrol", SCONTROL), ("nvidia-smi", "exit 1")):
        (bin_dir / name).write_text(body if body.startswith("#!") else f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "NGPU", "LOG_", "MASTER_", "SHUTDOWN_", "PRELOAD_"))
    }
    return {**env, "PATH": f"{bin_dir}:{env['PATH']}", "RECORD": str(tmp_path / "calls.txt")}


def _calls(tmp_path: Path) -> list[list[str]]:
    return [shlex.split(line) for line in (tmp_path / "calls.txt").read_text().splitlines()]


def test_run_local_defaults_and_overrides(tmp_path: Path) -> None:
    env = _fake_bin(tmp_path)
    log_dir = tmp_path / "logs"
    subprocess.run(["bash", "launch/run_local.sh", "trainer.max_steps=3", "output_dir=runs/a b"], cwd=REPO,
                   env={**env, "LOG_DIR": str(log_dir)}, check=True, capture_output=True)  # fmt: skip
    (call,) = _calls(tmp_path)
    assert call[0] == "torchrun"
    assert "--nproc-per-node=2" in call  # no GPU visible: 2 CPU ranks
    assert "--master-port=29500" in call and f"--log-dir={log_dir}" in call and "--tee=3" in call
    assert "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" in call  # USR1: save and stop
    assert "--shutdown-timeout=270" in call  # torchrun's own default of 30 s is shorter than a step and a save
    assert call[-6:] == ["-m", "gtpo_megatron.train", "--config", "configs/cpu_demo.yaml", "trainer.max_steps=3",
                         "output_dir=runs/a b"]  # fmt: skip
    assert log_dir.is_dir()


def test_run_local_knobs(tmp_path: Path) -> None:
    env = {**_fake_bin(tmp_path), "NGPU": "8", "CONFIG": "configs/x.yaml", "MASTER_PORT": "31000",
           "LOG_DIR": str(tmp_path / "l"), "LOG_RANK": "0,7", "SHUTDOWN_TIMEOUT": "600"}  # fmt: skip
    subprocess.run(["bash", "launch/run_local.sh"], cwd=REPO, env=env, check=True, capture_output=True)
    (call,) = _calls(tmp_path)
    assert {"--nproc-per-node=8", "--master-port=31000", "--local-ranks-filter=0,7", "--shutdown-timeout=600"} <= set(
        call
    )
    assert call[-3:] == ["gtpo_megatron.train", "--config", "configs/x.yaml"]


def test_run_local_leaves_ld_preload_to_the_engine(tmp_path: Path) -> None:
    """The launcher sets no LD_PRELOAD: the CPU engine's process gets its own (``rollout/cpu_preload.py``)."""
    env = _fake_bin(tmp_path)
    (tmp_path / "bin" / "torchrun").write_text('#!/usr/bin/env bash\necho "${LD_PRELOAD:-}" >> "$RECORD"\n')
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_text("")
    for preload in ("", "/x/libother.so"):
        run_env = {**env, "LOG_DIR": str(tmp_path / "l"), "LD_PRELOAD": preload}
        subprocess.run(["bash", "launch/run_local.sh"], cwd=REPO, env=run_env, check=True, capture_output=True)
    assert (tmp_path / "calls.txt").read_text().splitlines() == ["", "/x/libother.so"]


def test_submit_sbatch_one_torchrun_per_node_at_the_head_node(tmp_path: Path) -> None:
    env = {
        **_fake_bin(tmp_path),
        "SLURM_SUBMIT_DIR": str(REPO),
        "SLURM_NNODES": "2",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "gpu-node-[07-08]",
        "SLURM_GPUS_ON_NODE": "8",
        "LOG_DIR": str(tmp_path / "l"),
    }
    # sbatch runs a spooled copy of the script from elsewhere; SLURM_SUBMIT_DIR is the repository root
    script = tmp_path / "spooled.sbatch"
    script.write_text((REPO / "launch" / "submit.sbatch").read_text())
    subprocess.run(["bash", str(script), "configs/llama3.1-70b_math_gtpo_64gpu.yaml", "optim.lr=2e-6"],
                   cwd=tmp_path, env=env, check=True, capture_output=True)  # fmt: skip
    srun, *torchruns = _calls(tmp_path)
    assert srun[0] == "srun" and "--nodes=2" in srun and "--ntasks-per-node=1" in srun
    assert len(torchruns) == 2
    for node, call in enumerate(torchruns):
        assert call[0] == "torchrun"
        assert {"--nnodes=2", "--nproc-per-node=8", "--rdzv-backend=c10d", "--rdzv-endpoint=gpu-node-07:29500",
                "--rdzv-id=4242", f"--log-dir={tmp_path / 'l'}/node_{node}"} <= set(call)  # fmt: skip
        assert call[-5:] == ["-m", "gtpo_megatron.train", "--config", "configs/llama3.1-70b_math_gtpo_64gpu.yaml",
                             "optim.lr=2e-6"]  # fmt: skip


# srun that waits like a running job; on SIGUSR1 it records it (srun forwards it to its tasks) and exits with 3.
WAITING_SRUN = """#!/usr/bin/env bash
printf 'srun' >> "$RECORD"; for a in "$@"; do printf ' %q' "$a" >> "$RECORD"; done; printf '\\n' >> "$RECORD"
trap 'echo "srun got USR1" >> "$RECORD"; exit 3' USR1
for _ in $(seq 600); do sleep 0.1; done
"""


def test_submit_sbatch_asks_for_usr1_and_forwards_it_to_the_ranks(tmp_path: Path) -> None:
    text = (REPO / "launch" / "submit.sbatch").read_text()
    assert "#SBATCH --signal=B:USR1@300" in text
    env = {
        **_fake_bin(tmp_path),
        "SLURM_SUBMIT_DIR": str(REPO),
        "SLURM_NNODES": "1",
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": "gpu-node-07",
        "LOG_DIR": str(tmp_path / "l"),
    }
    (tmp_path / "bin" / "srun").write_text(WAITING_SRUN)
    job = subprocess.Popen(["bash", "launch/submit.sbatch", "configs/x.yaml"], cwd=REPO, env=env,
                           stderr=subprocess.PIPE, text=True)  # fmt: skip
    record = tmp_path / "calls.txt"
    deadline = time.monotonic() + 30
    while not (record.exists() and "\n" in record.read_text()):  # srun started (its line is complete)
        assert job.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    (torchrun,) = [a for a in shlex.split(record.read_text().splitlines()[0]) if "exec torchrun" in a]
    assert "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" in torchrun
    assert '--shutdown-timeout="$GTPO_SHUTDOWN_TIMEOUT"' in torchrun
    job.send_signal(signal.SIGUSR1)  # what Slurm does 300 s before the time limit
    assert job.wait(timeout=30) == 3  # the batch shell waited for srun and kept its exit status
    assert record.read_text().splitlines()[-1] == "srun got USR1"
    assert "the ranks save at the next step boundary" in job.stderr.read()


def test_submit_sbatch_outside_slurm_fails_with_a_hint(tmp_path: Path) -> None:
    result = subprocess.run(["bash", "launch/submit.sbatch", "configs/x.yaml"], cwd=REPO, env=_fake_bin(tmp_path),
                            capture_output=True, text=True)  # fmt: skip
    assert result.returncode != 0 and "sbatch" in result.stderr


def test_dry_run_runs_the_planner() -> None:
    ok = subprocess.run(["bash", "launch/dry_run.sh", "configs/qwen2.5-32b_gsm8k_gtpo_64gpu.yaml", "64"],
                        cwd=REPO, capture_output=True, text=True)  # fmt: skip
    assert ok.returncode == 0 and "tp 8 x pp 1 x dp 8" in ok.stdout
    bad = subprocess.run(["bash", "launch/dry_run.sh", "configs/qwen2.5-32b_gsm8k_gtpo_64gpu.yaml", "64",
                          "rollout.num_prompts=1", "algorithm.group_size=6"],
                         cwd=REPO, capture_output=True, text=True)  # fmt: skip
    assert bad.returncode == 2 and "use rollout.num_prompts=4" in bad.stderr  # 4 * 6 = 24 splits over dp 8


def test_compare_cpu_runs_every_method_and_seed_then_the_comparison(tmp_path: Path) -> None:
    env = _fake_bin(tmp_path)
    (tmp_path / "bin" / "python").write_text(RECORDER)
    (tmp_path / "bin" / "python").chmod(0o755)
    subprocess.run(["bash", "launch/compare_cpu.sh", "trainer.max_steps=2"], cwd=REPO,
                   env={**env, "OUT": "runs/cmp"}, check=True, capture_output=True)  # fmt: skip
    calls = _calls(tmp_path)
    assert [c[0] for c in calls] == ["torchrun"] * 7 + ["python"]
    runs = [f"runs/cmp/{m}/seed{s}" for s in (0, 1) for m in ("grpo", "dapo", "gtpo")] + ["runs/cmp/gtpo-filter/seed0"]
    for call, run in zip(calls, runs):
        method, seed = run.split("/")[2], run[-1]
        algorithm = ["algorithm=gtpo", "algorithm.entropy_filter=fixed"] if method == "gtpo-filter" else [
            f"algorithm={method}"]  # fmt: skip
        assert "--nproc-per-node=2" in call
        seeds = [f"trainer.seed={seed}", f"rollout.seed={seed}", f"data.shuffle_seed={seed}"]
        tail = ["configs/compare_cpu.yaml", *algorithm, *seeds, f"output_dir={run}", "trainer.max_steps=2"]
        assert call[call.index("--config") + 1 :] == tail
    assert calls[-1][1:] == ["-m", "gtpo_megatron.evaluation.compare", *runs, "--output", "runs/cmp"]
