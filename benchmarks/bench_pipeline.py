"""Wall time of the async schedule over the fake trainer: sync, k = 1, 2, 3 and partial rollouts, back to back.

Usage: ``python benchmarks/bench_pipeline.py [--steps 6] [--generate-s 0.4] [--train-s 0.4]`` from the repository
root (it imports ``tests/trainer/fakes.py``). The fake engine sleeps for each batch's generation and the fake policy
for each update, so the numbers measure the schedule only (no CPU work: two idle cores suffice). Two workloads:

- ``even``: every batch takes ``--generate-s``;
- ``long-tailed``: every third batch takes 2.5x ``--generate-s``, the others 0.25x (the same mean).

``partial k=1`` / ``k=2`` (``rollout.partial_rollouts``): the weights land in flight and every queued batch is
sampled at once; the fake engine then runs batches side by side at no extra cost, as memory-bound decoding does
while the KV cache has room (a CPU engine does not: compute-bound, its batches share the cores).

Printed per workload and mode: the run's seconds (``Trainer.run`` without its plots; the fastest of ``--repeats``
runs, as other jobs on the cores only ever add time), the speed-up over sync, and the means of
``async/engine_busy_frac`` and ``async/trainer_wait_frac`` (rollout/pipeline.py's docstring has the arithmetic:
about n*(g + tau) in sync mode, g + n*max(g, tau) async; a larger k hides the long batches).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gtpo_megatron.trainer  # noqa: E402
from tests.trainer.fakes import FakePolicy, SeededFakeEngine, make_trainer, one_rank_process_group  # noqa: E402

gtpo_megatron.trainer.plot_curves = lambda *args: None  # seconds of matplotlib after the last step, not measured

PARTIAL = ["rollout.partial_rollouts=true", "rollout.weight_sync=files", "algorithm.off_policy_correction=tis"]
MODES = {
    "sync": ["rollout.mode=sync"],
    **{f"async k={k}": ["rollout.mode=async", f"rollout.max_staleness={k}"] for k in (1, 2, 3)},
    **{f"partial k={k}": ["rollout.mode=async", f"rollout.max_staleness={k}", *PARTIAL] for k in (1, 2)},
}
WORKLOADS = {"even": (1.0, 1.0, 1.0), "long-tailed": (0.25, 0.25, 2.5)}  # generation scale of step % 3 = 1, 2, 0


class _SleepingEngine(SeededFakeEngine):
    def __init__(self, seconds: float, scales: tuple[float, ...]):
        super().__init__()
        self.seconds, self.scales = seconds, scales

    version = 0

    def pause(self):
        """Partial rollouts: the fake's requests need no pause."""

    def resume(self, version):
        """Label the next tokens ``version`` (None: keep the label)."""
        self.version = self.version if version is None else version

    def generate(self, prompt_ids, n, sampling, prompt_indices=None):
        step, first = sampling.seed // 1000, self.version
        time.sleep(self.seconds * self.scales[(step - 1) % len(self.scales)])
        groups = super().generate(prompt_ids, n, sampling, prompt_indices)
        for completion in (c for g in groups for c in g.completions):  # half before, half after any update
            half = len(completion.token_ids) // 2
            completion.token_versions = [first] * half + [self.version] * (len(completion.token_ids) - half)
        return groups


class _SleepingPolicy(FakePolicy):
    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds

    def train_step(self, batch, loss):
        time.sleep(self.seconds)
        return super().train_step(batch, loss)


def run_mode(out: Path, overrides: list[str], args: argparse.Namespace, scales: tuple[float, ...]) -> dict:
    """One run's seconds and its mean async fractions."""
    engine, policy = _SleepingEngine(args.generate_s, scales), _SleepingPolicy(args.train_s)
    trainer = make_trainer(
        out, "rollout.placement=separate", "checkpoint.every_n_steps=0", f"trainer.max_steps={args.steps}",
        *overrides, engine=engine, policy=policy,
    )  # fmt: skip
    start = time.perf_counter()
    trainer.run()
    seconds = time.perf_counter() - start
    trainer.close()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    mean = lambda key: statistics.fmean(float(r.get(key, 0.0)) for r in rows)  # noqa: E731
    return {"seconds": seconds, "busy": mean("async/engine_busy_frac"), "wait": mean("async/trainer_wait_frac"),
            "staleness": mean("async/staleness_mean")}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--generate-s", type=float, default=0.4)
    parser.add_argument("--train-s", type=float, default=0.4)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    world = one_rank_process_group()
    next(world)
    print(f"{args.steps} steps, generation {args.generate_s} s (mean), training {args.train_s} s")
    print(f"{'workload':<13}{'mode':<14}{'seconds':>9}{'vs sync':>9}{'engine busy':>13}{'trainer wait':>14}"
          f"{'staleness':>11}")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for workload, scales in WORKLOADS.items():
            sync_s = None
            for mode, overrides in MODES.items():
                out = Path(tmp) / workload / mode.replace(" ", "")
                runs = [run_mode(out / str(i), overrides, args, scales) for i in range(args.repeats)]
                result = min(runs, key=lambda run: run["seconds"])
                sync_s = sync_s or result["seconds"]
                print(f"{workload:<13}{mode:<14}{result['seconds']:>9.2f}{sync_s / result['seconds']:>8.2f}x"
                      f"{result['busy']:>13.2f}{result['wait']:>14.2f}{result['staleness']:>11.2f}")  # fmt: skip
    next(world, None)


if __name__ == "__main__":
    main()
