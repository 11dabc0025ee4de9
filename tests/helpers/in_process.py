"""Train the tiny test config in this process (the ``world`` fixture's one-rank world)."""

from __future__ import annotations

import json
from pathlib import Path

from backend.config import load_config, validate
from backend.logging.metric_keys import undocumented
from backend.train.trainer import Trainer
from tests.conftest import TINY


def train_in_process(world, run_dir: Path, overrides: list[str]) -> tuple[list[dict], Trainer]:
    """Run ``tests/configs/tiny.yaml`` with ``overrides`` (no resume, no checkpoints, quiet console)
    into ``run_dir``; return the rows of its metrics.jsonl and the trainer, its run-directory lock
    released so the same directory or process can train again."""
    quiet = ["checkpoint.resume=false", "checkpoint.interval=0", "logger.log_interval=1000"]
    cfg = validate(load_config(TINY, [f"logger.run_dir={run_dir}", *quiet, *overrides]))
    trainer = Trainer(cfg, world)
    trainer.train()
    trainer.metrics.close()
    for lock in trainer.locks:
        lock.release()
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert not undocumented(rows), f"metrics without a meaning in backend/logging/metric_keys.py: {undocumented(rows)}"
    return rows, trainer
