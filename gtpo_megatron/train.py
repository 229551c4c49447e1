"""Entry point: ``torchrun --nproc_per_node=N -m gtpo_megatron.train --config X.yaml [key.sub=value ...]``.

Also the ``gtpo-train`` console script. Parses the config and dotted overrides, validates them for the world size,
initialises torch.distributed and Megatron's groups, writes ``output_dir/config.yaml``, builds the components,
runs the loop and tears everything down. Without torchrun it runs as a single process (world size 1).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch

from gtpo_megatron.config import load_config, save_config
from gtpo_megatron.logging import (
    PhaseTimer,
    format_startup_line,
    quiet_known_warnings,
    report_optional_accelerators,
    setup_logging,
)
from gtpo_megatron.megatron_adapter.settings import policy_settings
from gtpo_megatron.megatron_adapter.validation import validate_config
from gtpo_megatron.plan.layout import smallest_world_size
from gtpo_megatron.preemption import hold_stop_signals, release_stop_signals
from gtpo_megatron.run_dir import check_fresh_run, config_path, resolve_megatron_lm_checkpoint


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """``--config PATH`` plus any number of ``key.sub=value`` overrides (``algorithm=grpo``, ``data=gsm8k``)."""
    parser = argparse.ArgumentParser(prog="gtpo-train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="YAML recipe, e.g. configs/cpu_demo.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.max_steps=5 output_dir=runs/x")
    return parser.parse_args(argv)


def _single_process_defaults() -> bool:
    """Let ``python -m gtpo_megatron.train`` run without torchrun (world size 1 on a free local port).

    Returns whether it did (no launcher set ``RANK``).
    """
    if "RANK" in os.environ:
        return False
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return True


def _report_config_error(err: ValueError) -> None:
    """Say a config error once per node: local rank 0 writes it, the other ranks stay silent.

    Under torchrun (``TORCHELASTIC_ERROR_FILE`` set) it goes to that file, which torchrun's failure report prints
    as the root cause; printing it as well would show it twice. Otherwise it goes to stderr.
    """
    message = f"gtpo-train: config error: {err}"
    if os.environ.get("LOCAL_RANK", "0") != "0":
        time.sleep(2.0)  # torchrun reports the first rank to exit: let local rank 0, which says why, be that one
        return
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file:
        print(message, file=sys.stderr)
        return
    info = {"py_callstack": message, "timestamp": str(int(time.time()))}  # torch's ErrorHandler format
    Path(error_file).write_text(json.dumps({"message": {"message": message, "extraInfo": info}}))


def _check_inputs(cfg) -> None:
    """The Megatron checkpoint and the data exist (the model: ``validate_config``); a typo fails before any loading."""
    from gtpo_megatron.data.datasets import check_source

    if cfg.model.megatron_checkpoint is not None:
        resolve_megatron_lm_checkpoint(cfg.model.megatron_checkpoint)
    check_source(cfg.data.source, path=cfg.data.path, split=cfg.data.split, prefix="data.")


def main(argv: list[str] | None = None) -> int:
    """Run one training job; returns the exit code (0 on success, 2 on a config error, printed without a traceback)."""
    hold_stop_signals()  # a save request during start-up waits for the first step boundary
    imported, age = time.perf_counter(), _process_age_s()
    args = parse_args(argv)
    alone = _single_process_defaults()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        cfg = _checked_config(args, alone=alone)
    except ValueError as err:
        _report_config_error(err)
        return 2
    if not cfg.checkpoint.save_on_sigusr1:
        release_stop_signals()
    timer = PhaseTimer()
    timer.seconds["time/startup/imports_s"] = age
    timer.seconds["time/startup/config_s"] = time.perf_counter() - imported
    return _train(cfg, timer, started=imported - age)


def _process_age_s() -> float:
    """Seconds since this process started (Linux ``/proc``; 0 elsewhere): the interpreter and the imports."""
    try:
        since_boot = float(Path("/proc/uptime").read_text().split()[0])
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()  # from field 3 (state) on
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time in clock ticks since boot
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(since_boot - started, 0.0)


def _checked_config(args: argparse.Namespace, *, alone: bool = False):
    """The validated config of ``args`` whose model and data exist (raises ``ValueError`` otherwise).

    ``alone``: started without a launcher, so a layout of several ranks asks for torchrun.
    """
    cfg = load_config(args.config, args.overrides)
    par = cfg.parallel
    ranks = smallest_world_size(tp_size=par.tp_size, pp_size=par.pp_size, ep_size=par.ep_size)
    if alone and ranks > 1:
        overrides = "".join(f" {item}" for item in args.overrides)
        raise ValueError(
            f"parallel.tp_size/pp_size/ep_size={par.tp_size}/{par.pp_size}/{par.ep_size} needs {ranks} ranks and "
            f"gtpo-train alone is one process; run torchrun --nproc_per_node={ranks} -m gtpo_megatron.train "
            f"--config {args.config}{overrides}"
        )
    if not cfg.logging.verbose:
        quiet_known_warnings(cuda=torch.cuda.is_available())  # before megatron-core is imported (validate)
    validate_config(cfg, int(os.environ["WORLD_SIZE"]))
    policy_settings(cfg)  # refuses what the policy cannot build (e.g. overrides of owned fields) before any init
    _check_inputs(cfg)
    check_fresh_run(cfg.output_dir, resume=cfg.resume)
    return cfg


def _train(cfg, timer, *, started: float) -> int:
    """Initialise the distributed groups, build the trainer, run it and tear everything down."""
    from gtpo_megatron.build import build_trainer
    from gtpo_megatron.parallel.groups import destroy_distributed, init_distributed
    from gtpo_megatron.rollout.engine_guard import close_all

    with timer.phase("startup/distributed_init"):
        backend = None if cfg.parallel.backend == "auto" else cfg.parallel.backend
        groups = init_distributed(
            tp_size=cfg.parallel.tp_size,
            pp_size=cfg.parallel.pp_size,
            ep_size=cfg.parallel.ep_size,
            backend=backend,
            timeout_s=cfg.world_timeout_s,  # a rank may wait this long for an engine leader's batch
        )
    logger = setup_logging(groups.rank)
    if groups.rank == 0:
        report_optional_accelerators(logger)
        save_config(cfg, config_path(cfg.output_dir))
        logger.info(
            "config written to %s (world %d: tp=%d pp=%d dp=%d)",
            config_path(cfg.output_dir),
            groups.world_size,
            groups.tp_size,
            groups.pp_size,
            groups.dp_size,
        )
        if cfg.optim.packing and cfg.optim.max_tokens_per_micro_batch is None:
            logger.info(
                "optim.packing: %d tokens a micro-batch, optim.micro_batch_size=%d full-length rows "
                "(rollout.max_prompt_len + rollout.max_tokens = %d); set optim.max_tokens_per_micro_batch to change it",
                cfg.max_tokens_per_micro_batch,
                cfg.optim.micro_batch_size,
                cfg.rollout.max_prompt_len + cfg.rollout.max_tokens,
            )
    torch.manual_seed(cfg.trainer.seed)
    trainer = build_trainer(cfg, groups, timer=timer)
    trainer.sink.write(format_startup_line(timer.seconds, time.perf_counter() - started))
    try:
        trainer.run()
    finally:
        close_all([("the trainer", trainer.close), ("the process groups", destroy_distributed)])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
