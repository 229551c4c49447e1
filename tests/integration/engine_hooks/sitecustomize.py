"""A weight sync that kills its engine (``test_engine_failure.py``): on ``PYTHONPATH`` of a job, with
``GTPO_TEST_KILL_IN_SYNC`` naming a marker file, rank 1's engine worker SIGKILLs itself during its first weight
update, once its first tensor arrived (the marker makes it once: the restarted engine is left alone)."""

import os
import signal

_MARKER = os.environ.get("GTPO_TEST_KILL_IN_SYNC")

if _MARKER and os.environ.get("RANK") == "1" and not os.path.exists(_MARKER):
    from gtpo_megatron.rollout import vllm_worker

    _receive = vllm_worker.WeightReloadExtension.gtpo_receive_weights

    def _dying(self):
        def reload_weights(weights_iterator):
            next(weights_iterator)
            if not os.path.exists(_MARKER):
                open(_MARKER, "w").close()  # noqa: SIM115 - an empty marker
                os.kill(os.getpid(), signal.SIGKILL)

        self.reload_weights = reload_weights
        return _receive(self)

    vllm_worker.WeightReloadExtension.gtpo_receive_weights = _dying
