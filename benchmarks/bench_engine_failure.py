"""``rollout.fault_tolerance`` on the CPU demo workload: what an engine failure costs, measured.

Usage: ``python benchmarks/bench_engine_failure.py [--steps 24] [--out /tmp/bench_engine_failure]``

Five 2-rank jobs in turn (``torchrun``, builtin:tiny-qwen2, two engines led by ranks 0 and 1, the overrides of
``tests/integration/test_engine_failure.py``): undisturbed; engine 1's engine core SIGKILLed once step 1 is logged;
the same SIGSTOPped (a hung engine); engine 1's worker SIGKILLed during its first weight update, after its first
tensor arrived; engine 1 SIGKILLed 0.05 s into step 2's generation (``tests/integration/engine_hooks``).
Printed per job: whether its untimed metrics equal the undisturbed run's (the same prompts and completions),
``rollout/engine_restarts`` at the end, the moved prompts, ``rollout/recovery_s``, the step of the failure's time
and the median step time with one engine against the undisturbed median (a ratio). Run on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.integration.test_engine_failure import _run, untimed  # noqa: E402


def _job(out: Path, steps: int, case: str) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    sig = {"killed": signal.SIGKILL, "stopped": signal.SIGSTOP}.get(case)
    hook = case.removeprefix("killed in a ") if case.startswith("killed in") else None
    records, _ = _run(out / "run", kill_after_step=1 if sig else None, sig=sig or signal.SIGKILL, steps=steps,
                      hook=hook)  # fmt: skip
    return records


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench_engine_failure"))
    parser.add_argument("--cases", default="killed,stopped,killed in a sync,killed in a generation")
    args = parser.parse_args()
    results = {}
    for case in ("undisturbed", *args.cases.split(",")):
        results[case] = _job(args.out / case.replace(" ", "_"), args.steps, case)
    base = results["undisturbed"]
    base_step = statistics.median(r["time/step_s"] for r in base[1:])
    print(f"undisturbed: {len(base)} steps, median step {base_step:.2f} s, step 1 {base[0]['time/step_s']:.1f} s "
          f"(sync {base[0]['time/sync_s']:.2f} s)")  # fmt: skip
    for case, records in list(results.items())[1:]:
        one = [r["time/step_s"] for r in records if r["rollout/engines_alive"] == 1]
        one_s = statistics.median(one)
        first = next(i for i, r in enumerate(records) if r["rollout/engine_restarts"] > 0)
        around = [f"step {r['step']} {r['time/step_s']:.1f} s (sync {r['time/sync_s']:.2f} s, undisturbed "
                  f"{base[r['step'] - 1]['time/step_s']:.1f} s)" for r in records[first - 1 : first + 1]]  # fmt: skip
        recovery = [round(r["rollout/recovery_s"], 1) for r in records if "rollout/recovery_s" in r]
        print(f"{case}: {len(records)} steps; same prompts and completions as undisturbed: "
              f"{[untimed(r) for r in records] == [untimed(r) for r in base]}; engine_restarts "
              f"{records[-1]['rollout/engine_restarts']:g}; requests_moved "
              f"{sum(r['rollout/requests_moved'] for r in records):g}; recovery_s {recovery}; around the failure "
              f"(a sync's failure counts in the next step): {'; '.join(around)}; steps with one engine {len(one)}, "
              f"median {one_s:.2f} s ({one_s / base_step:.2f}x undisturbed)")  # fmt: skip


if __name__ == "__main__":
    main()
