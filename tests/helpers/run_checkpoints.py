"""A run's first checkpoint, as the trainer writes it: what the export tests read back.

:func:`train_and_save` is one rank's part of a 2-rank gloo job (``dist_harness.run_distributed``): rank 0 saves the
run config to ``RUN_DIR/config.yaml``, every rank builds the fp32 TP=2 policy of that config, takes one optimizer step
at lr 1e-2 without clipping (the weights then differ from the base model) and saves ``checkpoints/step_000001``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tests.adapter.megatron_helpers import make_batch


def train_and_save(rank: int, run_dir: str, model: str, overrides: Sequence[str] = ()):
    """Build, train one step, save ``RUN_DIR/checkpoints/step_000001``; returns this rank's policy.

    ``overrides``: dotted config overrides past the shared ones (e.g. ``model.lora.rank=4``).
    """
    from gtpo_megatron.build import build_policy
    from gtpo_megatron.config import load_config, save_config
    from gtpo_megatron.ops import LossSpec
    from gtpo_megatron.parallel.groups import init_distributed

    shared = [f"model={model}", f"output_dir={run_dir}", "model.params_dtype=float32", "parallel.tp_size=2",
              "optim.lr=1e-2", "optim.min_lr=1e-2", "optim.clip_grad=0"]  # fmt: skip
    cfg = load_config(None, [*shared, *overrides])
    if rank == 0:
        save_config(cfg, Path(run_dir) / "config.yaml")
    policy = build_policy(cfg, cfg.model.name_or_path, init_distributed(tp_size=2))
    loss = LossSpec(loss_name="gtpo", aggregation="seq-mean-token-mean", clip_eps_low=0.2, clip_eps_high=0.2)
    metrics = policy.train_step(make_batch(rows=4, seed=3), loss)
    assert metrics["skipped"] == 0.0, metrics
    policy.save_checkpoint(f"{run_dir}/checkpoints/step_000001", {"step": 1})
    return policy
