"""``model.megatron_checkpoint``: Megatron-LM's folder layout, the config field, and the loader's refusals.

The loader runs on a tiny dist checkpoint written in a one-process gloo world with ``dist_checkpointing.save``;
the TP/PP resharding itself is ``tests/plugin/test_megatron_checkpoint.py``.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist

from gtpo_megatron.config import ModelConfig, load_config
from gtpo_megatron.run_dir import resolve_megatron_lm_checkpoint
from gtpo_megatron.train import _check_inputs


def _dist_checkpoint(folder, tensors: dict[str, torch.Tensor]) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    from gtpo_megatron.megatron_adapter.cpu_compat import cuda_to_cpu_mode

    folder.mkdir(parents=True)
    state = {k: ShardedTensor.from_rank_offsets(k, v, replica_id=0) for k, v in tensors.items()}
    with cuda_to_cpu_mode():
        dist_checkpointing.save(state, str(folder))


@pytest.fixture(scope="module")
def checkpoint_root(tmp_path_factory):
    """A Megatron-LM-style root: iteration 20 holds an embedding of 256 x 4 and a final norm of 4."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    root = tmp_path_factory.mktemp("megatron_lm")
    tensors = {"embedding.word_embeddings.weight": torch.randn(256, 4), "decoder.final_layernorm.weight": torch.ones(4)}
    _dist_checkpoint(root / "iter_0000020", tensors)
    (root / "latest_checkpointed_iteration.txt").write_text("20\n")
    yield root
    dist.destroy_process_group()


def test_folder_layout(checkpoint_root, tmp_path):
    iteration = checkpoint_root / "iter_0000020"
    assert resolve_megatron_lm_checkpoint(checkpoint_root) == iteration
    assert resolve_megatron_lm_checkpoint(iteration) == iteration
    (tmp_path / "release").mkdir()
    (tmp_path / "release" / "metadata.json").write_text("{}")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release")
    assert resolve_megatron_lm_checkpoint(tmp_path) == tmp_path / "release"
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("7")
    with pytest.raises(ValueError, match="says '7' but .*iter_0000007 is not a dist checkpoint"):
        resolve_megatron_lm_checkpoint(tmp_path)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("latest")
    with pytest.raises(ValueError, match="holds 'latest', neither an iteration number nor 'release'"):
        resolve_megatron_lm_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="holds neither a dist checkpoint"):
        resolve_megatron_lm_checkpoint(tmp_path / "release" / "missing")


def test_config_field_and_early_check(checkpoint_root):
    cfg = load_config(
        None, ["model=builtin:tiny-llama", f"model.megatron_checkpoint={checkpoint_root}", "output_dir=x"]
    )
    assert cfg.model.megatron_checkpoint == str(checkpoint_root)
    _check_inputs(cfg)  # the folder resolves
    missing = load_config(None, ["model=builtin:tiny-llama", "model.megatron_checkpoint=/nonexistent", "output_dir=x"])
    with pytest.raises(ValueError, match="model.megatron_checkpoint='/nonexistent'"):
        _check_inputs(missing)
    with pytest.raises(ValueError, match="model.megatron_checkpoint/model.pad_attention_heads"):
        ModelConfig(name_or_path="x", megatron_checkpoint="ckpt", pad_attention_heads=True)
    with pytest.raises(ValueError, match="must not be empty"):
        ModelConfig(name_or_path="x", megatron_checkpoint="")


def test_padded_vocabulary_comes_from_the_checkpoint(checkpoint_root):
    from gtpo_megatron.megatron_adapter.external_checkpoint import checkpoint_padded_vocab_size

    assert checkpoint_padded_vocab_size(checkpoint_root, vocab_size=250, tp_size=2) == 256
    with pytest.raises(ValueError, match="256 embedding rows but the tokenizer .* vocab_size=300"):
        checkpoint_padded_vocab_size(checkpoint_root, vocab_size=300, tp_size=1)
    with pytest.raises(ValueError, match="pads the vocabulary to 256 rows, which parallel.tp_size=3 does not divide"):
        checkpoint_padded_vocab_size(checkpoint_root, vocab_size=250, tp_size=3)


class _Stage(torch.nn.Module):
    """A model stage whose sharded state dict asks for the given (key, shape) tensors."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]):
        super().__init__()
        self.shapes = shapes
        self.values = {k: torch.zeros(shape) for k, shape in shapes.items()}

    def sharded_state_dict(self):
        from megatron.core.dist_checkpointing import ShardedTensor

        return {k: ShardedTensor.from_rank_offsets(k, v, replica_id=0) for k, v in self.values.items()}

    def load_state_dict(self, state):
        self.loaded = state


def test_loader_reads_weights_only_and_refuses_another_model(checkpoint_root):
    from gtpo_megatron.megatron_adapter.external_checkpoint import load_model_weights

    stage = _Stage({"embedding.word_embeddings.weight": (256, 4)})
    load_model_weights(stage, checkpoint_root)
    assert stage.loaded["embedding.word_embeddings.weight"].shape == (256, 4)
    with pytest.raises(
        ValueError, match=r"does not match .*the checkpoint has no \['decoder.layers.0.mlp.linear_fc1.weight'"
    ):
        load_model_weights(_Stage({"decoder.layers.0.mlp.linear_fc1.weight": (8, 4)}), checkpoint_root)
    with pytest.raises(ValueError, match="does not match the model built from model.name_or_path's HF config"):
        load_model_weights(_Stage({"embedding.word_embeddings.weight": (128, 4)}), checkpoint_root)
