"""vLLM's console output: WARNING and above, without the warnings that this project's own settings make harmless.

Unless ``logging.verbose`` is set, every vLLM process logs at WARNING: this one directly
(:func:`quiet_this_process`), the engine's through ``VLLM_LOGGING_LEVEL`` and a config file
(:func:`child_log_environment`). :class:`HarmlessVllmRecords` drops the records of :data:`HARMLESS`, each with the
reason it is harmless here (the tied LM head's only when the model ties its embeddings). Stdlib only: vLLM's
processes import this module to build the filter.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

# (text found in the message, why the record is harmless in this project)
HARMLESS = (
    ("Attempted to load weight", "the checkpoint is cast to the engine's dtype (rollout.dtype) on purpose"),
    ("RotaryEmbedding: Failed to load weights", "rotary embeddings have no weights to reload"),
    ("Enforce eager set", "the engine runs eager on purpose (enforce_eager)"),
    ("Inductor compilation was disabled", "the engine runs eager on purpose (enforce_eager)"),
    ("officially support disabling chunked prefill", "chunked prefill is off on CPU on purpose (seeded requests)"),
    ("exceeds max_num_seqs * max_model_len", "chunked prefill is off on CPU on purpose (seeded requests)"),
    ("requires Triton", "vLLM's CPU build runs without Triton"),
    ("Triton is not installed", "vLLM's CPU build runs without Triton"),
    ("doesn't include CPU backend", "vLLM's CPU build runs without Triton"),
    ("Reset SSM cache type", "the supported models have no state-space layers"),
    ("[shutdown]", "closing the engine stops its processes"),
)
TIED_HEAD = ("ParallelLMHead: Failed to load weights", "a tied LM head is embed_tokens and is reloaded with it")
_WARNINGS_TO_HIDE = "ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning"  # vLLM's dispatcher, in torch
_FORMAT = "(%(vllm_process_name)s pid=%(process)d) %(levelname)s %(asctime)s [%(fileinfo)s:%(lineno)d] %(message)s"


class HarmlessVllmRecords(logging.Filter):
    """Drops the log records of :data:`HARMLESS` (and :data:`TIED_HEAD` with ``tied_embeddings``)."""

    def __init__(self, tied_embeddings: bool = False) -> None:
        super().__init__()
        self.texts = tuple(text for text, _ in HARMLESS) + ((TIED_HEAD[0],) if tied_embeddings else ())

    def filter(self, record: logging.LogRecord) -> bool:
        """False (drop) when the message contains one of the harmless texts."""
        message = record.getMessage()
        return not any(text in message for text in self.texts)


def ties_embeddings(model_path: str) -> bool:
    """Whether the HF folder ``model_path`` ties its LM head to the embeddings (False when it cannot tell)."""
    try:
        return bool(json.loads((Path(model_path) / "config.json").read_text()).get("tie_word_embeddings", False))
    except (OSError, ValueError):
        return False


def quiet_this_process(*, tied_embeddings: bool) -> None:
    """WARNING and the filter for this process's ``vllm`` loggers; call before and after importing vLLM."""
    vllm_logger = logging.getLogger("vllm")
    vllm_logger.setLevel(logging.WARNING)
    for target in (logging.getLogger("vllm.triton_utils.importing"), *vllm_logger.handlers):
        if not any(isinstance(f, HarmlessVllmRecords) for f in target.filters):
            target.addFilter(HarmlessVllmRecords(tied_embeddings))


def child_log_environment(folder: str | Path, *, tied_embeddings: bool) -> dict[str, str]:
    """Environment for the engine's processes; writes ``folder/vllm_logging.json``, which must outlive their start."""
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"vllm": {"()": "vllm.logging_utils.NewLineFormatter", "format": _FORMAT, "datefmt": "%H:%M:%S"}},
        "filters": {
            "harmless": {"()": f"{__name__}.HarmlessVllmRecords", "tied_embeddings": tied_embeddings},
        },
        "handlers": {
            "vllm": {
                "class": "logging.StreamHandler",
                "formatter": "vllm",
                "filters": ["harmless"],
                "level": "WARNING",
                "stream": "ext://sys.stdout",
            }
        },
        "loggers": {"vllm": {"handlers": ["vllm"], "level": "WARNING", "propagate": False}},
    }
    path = Path(folder) / "vllm_logging.json"
    path.write_text(json.dumps(config))
    python_warnings = ",".join(filter(None, (os.environ.get("PYTHONWARNINGS"), _WARNINGS_TO_HIDE)))
    return {"VLLM_LOGGING_LEVEL": "WARNING", "VLLM_LOGGING_CONFIG_PATH": str(path), "PYTHONWARNINGS": python_warnings}
