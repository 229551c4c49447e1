"""Entry point: ``torchrun --nproc_per_node=N -m gtpo_megatron.train --config X.yaml [key.sub=value ...]``.

Also the ``gtpo-train`` console script. Parses the config and dotted overrides, validates them for the world size,
initialises torch.distributed and Megatron's groups, writes ``output_dir/config.yaml``, builds the components,
runs the loop and tears everything down. Without torchrun it runs as a single process (world size 1).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

import torch

from gtpo_megatron.config import load_config, save_config
from gtpo_megatron.logging import setup_logging
from gtpo_megatron.preemption import ignore_stop_signals_in_children
from gtpo_megatron.run_dir import check_fresh_run, config_path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """``--config PATH`` plus any number of ``key.sub=value`` overrides (``algorithm=grpo``, ``data=gsm8k``)."""
    parser = argparse.ArgumentParser(prog="gtpo-train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="YAML recipe, e.g. configs/cpu_demo.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.max_steps=5 output_dir=runs/x")
    return parser.parse_args(argv)


def _single_process_defaults() -> None:
    """Let ``python -m gtpo_megatron.train`` run without torchrun (world size 1 on a free local port)."""
    if "RANK" in os.environ:
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def _check_inputs(cfg) -> None:
    """The model and the data exist (a typo fails here, not after minutes of model loading on every rank)."""
    from gtpo_megatron.builtin_models import check_model
    from gtpo_megatron.data.datasets import check_source

    check_model(cfg.model.name_or_path)
    check_source(cfg.data.source, path=cfg.data.path, split=cfg.data.split, prefix="data.")


def main(argv: list[str] | None = None) -> int:
    """Run one training job; returns the exit code (0 on success, 2 on a config error, printed without a traceback)."""
    args = parse_args(argv)
    _single_process_defaults()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        cfg = load_config(args.config, args.overrides)
        cfg.validate(int(os.environ["WORLD_SIZE"]))
        _check_inputs(cfg)
        check_fresh_run(cfg.output_dir, resume=cfg.resume)
    except ValueError as err:
        print(f"gtpo-train: config error: {err}", file=sys.stderr)
        return 2

    from gtpo_megatron.build import build_trainer
    from gtpo_megatron.parallel.groups import destroy_distributed, init_distributed

    backend = None if cfg.parallel.backend == "auto" else cfg.parallel.backend
    groups = init_distributed(tp_size=cfg.parallel.tp_size, pp_size=cfg.parallel.pp_size, backend=backend)
    logger = setup_logging(groups.rank)
    if groups.rank == 0:
        save_config(cfg, config_path(cfg.output_dir))
        logger.info(
            "config written to %s (world %d: tp=%d pp=%d dp=%d)",
            config_path(cfg.output_dir),
            groups.world_size,
            groups.tp_size,
            groups.pp_size,
            groups.dp_size,
        )
    torch.manual_seed(cfg.trainer.seed)
    if cfg.checkpoint.save_on_sigusr1:
        ignore_stop_signals_in_children()  # before the engine, reward and wandb processes start
    trainer = build_trainer(cfg, groups)
    try:
        trainer.run()
    finally:
        trainer.close()
        destroy_distributed()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
