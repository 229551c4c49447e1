"""A Megatron-LM / Megatron-Bridge checkpoint as the starting policy: its model weights, at any TP/PP layout.

Such a checkpoint (``model.megatron_checkpoint``; folder layout in ``run_dir``) is Megatron-Core's dist checkpoint
(``torch_dist``) of ``{"model": model.sharded_state_dict(), "optimizer": ..., "args": ..., ...}``. Only the model's
sharded tensors are read: every one is matched by its global key and resharded to this rank's TP/PP shard by
``dist_checkpointing.load`` (the same machinery as ``checkpoint.py``), the optimizer state, the RNG states and the
common ``common.pt`` (which holds Megatron-LM's pickled ``args``) are never opened. Transformer Engine and local
layer specs store the same keys (the local spec maps its norms onto TE's fused names), so a checkpoint written by a
TE model loads into the CPU local-spec model and back.

The vocabulary is padded as the writer padded it (Megatron-LM: to a multiple of ``make_vocab_size_divisible_by *
tp_size`` at the writer's TP size): :func:`checkpoint_padded_vocab_size` reads that row count from the checkpoint's
metadata, and the model is built with it, so the embedding and output layer match at every TP size that divides it.
Columns ``>= vocab_size`` stay excluded from every softmax (``ops``).
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
    """Keyword arguments for ``dist_checkpointing.load`` that skip the common (non-sharded) state.

    The common state (``common.pt``, or a ``common_state`` object inside newer checkpoints) holds Megatron-LM's
    pickled ``args`` and no model tensor. megatron-core 0.16 takes a ``common_strategy`` argument for it; 0.17 and
    later load it unconditionally through ``serialization.load_common_state_dict``, which is replaced by an empty
    load for the duration (feature detection on ``load``'s signature, not on version strings).
    """
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
    """Rows of the checkpoint's embedding: the padded vocabulary ``V`` the model must be built with.

    Args:
        path: ``model.megatron_checkpoint`` (root or iteration folder).
        vocab_size: the tokenizer's vocabulary (HF ``config.vocab_size``).
        tp_size: this run's tensor-parallel size.

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
    """Copy this rank's shards of the checkpoint's model weights into ``model``, in place.

    Args:
        model: this rank's *unwrapped* ``GPTModel`` stage, built with :func:`checkpoint_padded_vocab_size` rows and
            the architecture the checkpoint was written with; any TP/PP layout.
        path: ``model.megatron_checkpoint`` (root or iteration folder).

    Collectives: ``dist_checkpointing.load``'s own (world group).

    Raises:
        ValueError: the checkpoint lacks some of the model's tensors, or holds them with other shapes (another
            architecture, layer count or hidden size than the HF config of ``model.name_or_path``).
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
