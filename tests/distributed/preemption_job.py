"""The training job of ``test_preemption_torchrun.py``: ``gtpo_megatron.train.main`` with the fake engine.

Run as ``torchrun --nproc_per_node=2 tests/distributed/preemption_job.py --config CONFIG key=value ...``. Everything
is the real entry point (config, ``init_distributed``, ``build_trainer``, the Megatron policy, checkpoints, the
loop) except the vLLM engine and the reward pool, replaced by ``tests.trainer.fakes``. With
``GTPO_TEST_SLOW_CALL=k``, generate call ``k`` of rank 0 touches ``$GTPO_TEST_MARKER`` and then generates for
``GTPO_TEST_SLOW_S`` seconds (a step in flight that the test can kill).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: gtpo_megatron and tests

import gtpo_megatron.rewards  # noqa: E402
import gtpo_megatron.rollout.vllm_engine  # noqa: E402
from gtpo_megatron.train import main  # noqa: E402
from tests.trainer.fakes import FakeEngine, FakeRewardPool  # noqa: E402


class _SlowEngine(FakeEngine):
    """``FakeEngine`` built like ``VLLMEngine``; one chosen generate call is slow (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__()

    def generate(self, prompt_ids, n, sampling, prompt_indices=None):
        if len(self.calls) + 1 == int(os.environ.get("GTPO_TEST_SLOW_CALL", "0")):
            Path(os.environ["GTPO_TEST_MARKER"]).touch()
            time.sleep(float(os.environ["GTPO_TEST_SLOW_S"]))
        return super().generate(prompt_ids, n, sampling, prompt_indices)


gtpo_megatron.rollout.vllm_engine.VLLMEngine = _SlowEngine
gtpo_megatron.rewards.RewardPool = lambda *args, **kwargs: FakeRewardPool()

if __name__ == "__main__":
    raise SystemExit(main())
