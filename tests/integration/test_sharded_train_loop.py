"""``rollout.weight_sync: sharded`` in a real 2-rank job (``torchrun``, trainer TP=2, one CPU vLLM engine at TP 1).

Each TP rank sends its own shards to the engine's worker; the same job with the collective sync must train the
same steps: identical completions, rewards, losses and gradient norms in both steps, so the engine generated step
2 with the same weights after either update. ``slow``: two jobs of about 2 minutes each on the idle machine.
"""

from __future__ import annotations

import pytest

from tests.integration.test_two_engines import PER_ENGINE, _run

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _untimed(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(("time/", "perf/", "sync/")) and k not in PER_ENGINE}


def test_sharded_and_collective_syncs_train_the_same_steps(tmp_path):
    sharded, log = _run(tmp_path / "sharded", "parallel.tp_size=2", "rollout.weight_sync=sharded")
    collective, _ = _run(tmp_path / "collective", "parallel.tp_size=2", "rollout.weight_sync=collective")
    first = sharded[0]
    assert first["sync/num_senders"] == 2 and first["sync/busiest_sender_megabytes"] < first["sync/megabytes"]
    assert "sync/num_senders" not in collective[0] and len(sharded) == len(collective) == 2
    assert sharded[1]["mismatch/abs_logprob_diff"] < 1e-3  # the engine samples with the trainer's new weights
    assert [_untimed(r) for r in sharded] == [_untimed(r) for r in collective]
    print(
        f"[sharded job] sync {first['time/sync_s']:.3f} s, busiest sender {first['sync/busiest_sender_megabytes']:.1f}"
        f" of {first['sync/megabytes']:.1f} MiB"
    )
