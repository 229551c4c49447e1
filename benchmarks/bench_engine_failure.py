"""``rollout.fault_tolerance`` on the CPU demo workload: what an engine failure costs, measured.

Usage: ``python benchmarks/bench_engine_failure.py [--steps 24] [--out /tmp/bench_engine_failure]``

Four 2-rank jobs in turn (``torchrun``, builtin:tiny-qwen2, two engines led by ranks 0 and 1, the overrides of
``tests/integration/test_engine_failure.py``): undisturbed; engine 1's engine core SIGKILLed once step 1 is logged;
the same SIGSTOPped (a hung engine); engine 1 SIGKILLed during its first weight update (after its first tensor
arrived: a ``sitecustomize`` on the job's ``PYTHONPATH`` wraps the worker's load; a marker file makes it once).
Printed per job: whether its untimed metrics equal the undisturbed run's (the same prompts and completions),
``rollout/engine_restarts`` at the end, the moved prompts, ``rollout/recovery_s``, the step of the failure's time
and the median step time with one engine against the undisturbed median (a ratio). Run on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.integration.test_engine_failure import PER_ENGINE, RECOVERY, _run  # noqa: E402

KILL_IN_SYNC = textwrap.dedent("""
    import os, signal
    marker = os.environ.get("BENCH_KILL_IN_SYNC")
    if marker and os.environ.get("RANK") == "1" and not os.path.exists(marker):
        from gtpo_megatron.rollout import vllm_worker
        receive = vllm_worker.WeightReloadExtension.gtpo_receive_weights

        def dying(self):
            def reload_weights(weights_iterator):
                next(weights_iterator)
                if not os.path.exists(marker):
                    open(marker, "w").close()
                    os.kill(os.getpid(), signal.SIGKILL)
            self.reload_weights = reload_weights
            return receive(self)

        vllm_worker.WeightReloadExtension.gtpo_receive_weights = dying
""")


def _untimed(record: dict) -> dict:
    return {k: v for k, v in record.items()
            if not k.startswith(("time/", "perf/", "sync/")) and k not in PER_ENGINE + RECOVERY}  # fmt: skip


def _job(out: Path, steps: int, case: str) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    if case == "killed in a sync":
        hook = out / "hook"
        hook.mkdir(exist_ok=True)
        (hook / "sitecustomize.py").write_text(KILL_IN_SYNC)
        os.environ["BENCH_KILL_IN_SYNC"] = str(out / "killed")
        os.environ["PYTHONPATH"] = f"{hook}:{os.environ.get('PYTHONPATH', '')}"
    sig = {"killed": signal.SIGKILL, "stopped": signal.SIGSTOP}.get(case)
    records, _ = _run(out / "run", kill_after_step=1 if sig else None, sig=sig or signal.SIGKILL, steps=steps)
    return records


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench_engine_failure"))
    parser.add_argument("--cases", default="killed,stopped,killed in a sync", help="comma-separated")
    args = parser.parse_args()
    environ = dict(os.environ)
    results = {}
    for case in ("undisturbed", *args.cases.split(",")):
        results[case] = _job(args.out / case.replace(" ", "_"), args.steps, case)
        os.environ.clear()
        os.environ.update(environ)
    base = results["undisturbed"]
    base_step = statistics.median(r["time/step_s"] for r in base[1:])
    print(f"undisturbed: {len(base)} steps, median step {base_step:.2f} s")
    for case, records in list(results.items())[1:]:
        one = [r["time/step_s"] for r in records if r["rollout/engines_alive"] == 1]
        failed_at = next((i for i, r in enumerate(records) if r["rollout/engine_restarts"] > 0), None)
        recovery = [r["rollout/recovery_s"] for r in records if "rollout/recovery_s" in r]
        print(f"{case}: {len(records)} steps; same prompts and completions as undisturbed: "
              f"{[_untimed(r) for r in records] == [_untimed(r) for r in base]}; engine_restarts "
              f"{records[-1]['rollout/engine_restarts']:g}; requests_moved "
              f"{sum(r['rollout/requests_moved'] for r in records):g}; recovery_s {recovery}; failure step "
              f"{failed_at} took {records[failed_at]['time/step_s'] if failed_at is not None else 0:.1f} s; "
              f"steps with one engine {len(one)}, median {statistics.median(one) if one else 0:.2f} s "
              f"({statistics.median(one) / base_step if one else 0:.2f}x undisturbed)")  # fmt: skip


if __name__ == "__main__":
    main()
