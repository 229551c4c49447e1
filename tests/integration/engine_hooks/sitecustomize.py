"""Engine deaths at chosen moments (``test_engine_failure.py``), on ``PYTHONPATH`` of a job; each happens once (a
marker file) and only under training rank 1 (engine 1):

- ``GTPO_TEST_KILL_IN_SYNC=<marker>``: the engine worker SIGKILLs itself during its first weight update, once its
  first tensor arrived;
- ``GTPO_TEST_KILL_IN_GENERATION=<marker>``: the leader SIGKILLs its engine's processes 0.05 s into its second
  generation (step 2's rollout).
"""

import os
import signal
import threading
import time

_IN_SYNC = os.environ.get("GTPO_TEST_KILL_IN_SYNC")
_IN_GENERATION = os.environ.get("GTPO_TEST_KILL_IN_GENERATION")


def _once(marker: str) -> bool:
    if os.path.exists(marker):
        return False
    open(marker, "w").close()  # noqa: SIM115 - an empty marker
    return True


if os.environ.get("RANK") == "1" and _IN_SYNC and not os.path.exists(_IN_SYNC):
    from gtpo_megatron.rollout import vllm_worker

    _receive = vllm_worker.WeightReloadExtension.gtpo_receive_weights

    def _dying_receive(self):
        def reload_weights(weights_iterator):
            next(weights_iterator)
            if _once(_IN_SYNC):
                os.kill(os.getpid(), signal.SIGKILL)

        self.reload_weights = reload_weights
        return _receive(self)

    vllm_worker.WeightReloadExtension.gtpo_receive_weights = _dying_receive

if os.environ.get("RANK") == "1" and "LOCAL_RANK" in os.environ and _IN_GENERATION:
    from gtpo_megatron.rollout import engine_guard

    _generate, _calls = engine_guard.GuardedEngine.generate, []

    def _killing_generate(self, *args, **kwargs):
        _calls.append(None)
        if len(_calls) == 2 and _once(_IN_GENERATION):
            threading.Thread(target=_kill_soon, args=(self.engine._process_ids(),)).start()
        return _generate(self, *args, **kwargs)

    def _kill_soon(pids):
        time.sleep(0.05)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)

    engine_guard.GuardedEngine.generate = _killing_generate
