"""A Megatron-LM / Megatron-Bridge checkpoint as the starting policy: its model weights, at any TP/PP layout.

Only the model's sharded tensors of the ``torch_dist`` checkpoint are read, matched by global key and resharded
by ``dist_checkpointing.load``; optimizer, RNG and the pickled ``args`` are never opened. TE and local layer specs
store the same keys. The model is built with the checkpoint's padded vocabulary
(:func:`checkpoint_padded_vocab_size`); columns ``>= vocab_size`` stay out of every softmax.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from pathlib import Path

from gtpo_megatron.megatron_adapter.cpu_compat import cuda_to_cpu_mode
from gtpo_megatron.run_dir import resolve_megatron_lm_checkpoint

_EMBEDDING_KEY = "embedding.word_embeddings.weight"


@contextlib.contextmanager
def _common_state_skipped(dist_checkpointing) -> Iterator[dict]:
    """``dist_checkpointing.load`` kwargs that skip the common state (``common_strategy`` in 0.16, a patch in 0.17+)."""
    if "common_strategy" in inspect.signature(dist_checkpointing.load).parameters:
        from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

        class WeightsOnlyCommonLoadStrategy(TorchCommonLoadStrategy):
            """Loads no common objects: an external checkpoint contributes its model tensors only."""

            def load_common(self, checkpoint_dir):
                return {}

        yield {"common_strategy": WeightsOnlyCommonLoadStrategy()}
        return
    from megatron.core.dist_checkpointing import serialization

    original = serialization.load_common_state_dict
    serialization.load_common_state_dict = lambda checkpoint_dir: {}
    try:
        yield {}
    finally:
        serialization.load_common_state_dict = original


def checkpoint_padded_vocab_size(path: str | Path, *, vocab_size: int, tp_size: int) -> int:
    """Rows of the checkpoint's embedding: the padded vocabulary ``V`` to build the model with.

    Raises:
        ValueError: not a GPT checkpoint (no ``embedding.word_embeddings.weight``), fewer rows than ``vocab_size``
            (another tokenizer), or rows not divisible by ``tp_size``.
    """
    from megatron.core import dist_checkpointing

    folder = resolve_megatron_lm_checkpoint(path)
    metadata = dist_checkpointing.load_tensors_metadata(str(folder))
    if _EMBEDDING_KEY not in metadata:
        raise ValueError(
            f"model.megatron_checkpoint={str(path)!r} has no {_EMBEDDING_KEY!r}: not a GPT model checkpoint "
            f"(found e.g. {sorted(metadata)[:3]})"
        )
    rows = int(metadata[_EMBEDDING_KEY].global_shape[0])
    if rows < vocab_size:
        raise ValueError(
            f"model.megatron_checkpoint={str(path)!r} has {rows} embedding rows but the tokenizer of "
            f"model.name_or_path has vocab_size={vocab_size}; give the HF config and tokenizer the checkpoint was "
            "trained with"
        )
    if rows % tp_size:
        raise ValueError(
            f"model.megatron_checkpoint={str(path)!r} pads the vocabulary to {rows} rows, which "
            f"parallel.tp_size={tp_size} does not divide; choose a tp_size that divides {rows}"
        )
    return rows


def load_model_weights(model, path: str | Path) -> None:
    """Copy this rank's shards of the checkpoint's model weights into the unwrapped ``model`` stage, in place.

    Collectives: ``dist_checkpointing.load``'s own (world group).

    Raises:
        ValueError: tensors missing or of other shapes (another architecture than ``model.name_or_path``'s config).
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.validation import StrictHandling
    from torch.distributed.checkpoint.api import CheckpointException  # torch's wrapper around a rank's error

    folder = resolve_megatron_lm_checkpoint(path)
    with cuda_to_cpu_mode(), _common_state_skipped(dist_checkpointing) as skip_common:
        try:
            # Megatron's "unexpected" keys: requested by the model, absent from the checkpoint (its extra tensors,
            # such as the optimizer's, are "missing" keys and are ignored).
            loaded, _, unexpected = dist_checkpointing.load(
                model.sharded_state_dict(), str(folder), strict=StrictHandling.RETURN_UNEXPECTED, **skip_common
            )
        except (CheckpointingException, CheckpointException) as err:  # the last line names key and shapes
            raise ValueError(_mismatch(path, str(err).strip().splitlines()[-1])) from err
    if unexpected:
        raise ValueError(_mismatch(path, f"the checkpoint has no {sorted(unexpected)[:8]}"))
    model.load_state_dict(loaded)


def _mismatch(path, detail) -> str:
    return (
        f"model.megatron_checkpoint={str(path)!r} does not match the model built from model.name_or_path's HF "
        f"config ({detail}); give the config.json of the architecture the checkpoint was trained with"
    )
