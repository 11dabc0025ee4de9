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
    module = os.path.basename(sys.argv[0]) == "__main__.py"  # python -m backend.train, not backend-train
    parser = argparse.ArgumentParser(prog="python -m backend.train" if module else "backend-train", description=__doc__)
    parser.add_argument("config", help="YAML config file")
    parser.add_argument(
        "overrides", nargs="*", default=[], help="dotted.key=value overrides, applied in order (optional)"
    )
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    args = parser.parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cfg = validate(load_config(args.config, args.overrides), world_size=world_size)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.print_config:  # the file checks a real start makes too, then the config
        from backend.data.build import check_data_path

        paths = [src.path for src in cfg.data.blend] or [cfg.data.path]
        return run_main(lambda: [check_data_path(p) for p in paths] and print_resolved(cfg))

    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    logging.getLogger("megatron").setLevel(logging.WARNING)  # its INFO lines drown the progress
    from backend.distributed.setup import init_from_config, shutdown_distributed
    from backend.logging.wandb_run import start_wandb
    from backend.train.trainer import Trainer

    def run() -> int:
        env = init_from_config(cfg)
        try:
            trainer = Trainer(cfg, env)
            wandb_run = start_wandb(cfg, env, run_id=trainer.wandb_run_id)
            trainer.attach_wandb(wandb_run)
            outcome = trainer.train()
            trainer.end_summary(outcome)
            if wandb_run is not None:
                wandb_run.finish()
        finally:
            shutdown_distributed(env)
        return EXIT_INTERRUPTED if outcome == "interrupted" else 0

    return run_main(run)


def print_resolved(cfg) -> int:
    """The config as a run would resolve it on this machine (vocabulary from the tokenizer, sizes,
    precision and attention backend for this device), without building anything."""
    import torch

    from backend.config.run_values import resolve_run_config
    from backend.data.tokenizers import build_tokenizer
    from backend.model.attention import resolve_backend

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = build_tokenizer(cfg.data.tokenizer, eod=cfg.data.append_eod)
    resolved = resolve_run_config(cfg, tokenizer_vocab=tokenizer.vocab_size, device_type=device.type)
    logging.getLogger("backend.model.attention").setLevel(logging.WARNING)  # keep stdout pure YAML
    backend = resolve_backend(cfg.model.attention_backend, device=device)
    resolved.model.attention_backend = backend
    print(to_yaml(resolved), end="")
    return 0
