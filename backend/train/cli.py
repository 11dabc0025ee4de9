"""The training command: ``python -m backend.train CONFIG.yaml [dotted.key=value ...]`` or the
installed ``backend-train CONFIG.yaml ...``, also under torchrun.

Exit status: 0 finished (or stopped by SIGTERM/SIGUSR1 after saving: Slurm requeues and resumes);
130 stopped by Ctrl-C after saving (resumable: run the same command again); 2 a user error (a bad
config key, data file or checkpoint), printed as one line ``error: ...`` (set BACKEND_DEBUG=1 for
the traceback); 1 anything else (a bug: its traceback is the report).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from backend.config import ConfigError, load_config, to_yaml, validate
from backend.errors import run_main

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a Ctrl-C'd program


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="backend-train", description=__doc__)
    parser.add_argument("config", help="YAML config file")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides, applied in order")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    args = parser.parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cfg = validate(load_config(args.config, args.overrides), world_size=world_size)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(to_yaml(cfg), end="")
        return 0

    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    logging.getLogger("megatron").setLevel(logging.WARNING)  # its INFO lines drown the progress
    from backend.distributed.setup import init_distributed, shutdown_distributed
    from backend.logging.wandb_run import start_wandb
    from backend.train.trainer import Trainer

    def run() -> int:
        env = init_distributed(cfg.parallel.context_parallel_size, cfg.parallel.backend)
        try:
            trainer = Trainer(cfg, env)
            wandb_run = start_wandb(cfg, env, run_id=trainer.wandb_run_id)
            trainer.attach_wandb(wandb_run)
            outcome = trainer.train()
            trainer.end_summary(outcome)
            if wandb_run is not None:
                wandb_run.finish()
        finally:
            shutdown_distributed()
        return EXIT_INTERRUPTED if outcome == "interrupted" else 0

    return run_main(run)
