"""Where a run's files go, decided once (the trainer, tools and wandb resume all ask here)."""

from __future__ import annotations

from pathlib import Path


def checkpoint_dir(cfg) -> Path:
    """``checkpoint.dir``, or ``<logger.run_dir>/checkpoints`` when it is empty."""
    return Path(cfg.checkpoint.dir or Path(cfg.logger.run_dir) / "checkpoints")
