"""``checkpoint.keep_best``: the step with the lowest validation loss is saved when it is found,
kept beside the last ``keep_last`` checkpoints through every later pruning, recorded in
``best.json`` and named in the end summary; it needs evaluation to be on."""

from __future__ import annotations

import json
import logging

import pytest

from backend.checkpoint.store import complete_checkpoints, read_best
from backend.config import ConfigError, load_config, validate
from tests.conftest import TINY


def test_the_best_step_is_kept_beside_the_last(world, tmp_path, caplog):
    from backend.train.trainer import Trainer

    run = tmp_path / "run"
    keys = [
        f"logger.run_dir={run}",
        "logger.log_interval=1000",
        "train.train_iters=6",
        "train.eval_interval=1",
        "data.valid_fraction=0.2",
        "checkpoint.interval=0",  # only the end, and every new best
        "checkpoint.keep_last=1",
        "checkpoint.keep_best=true",
        "optimizer.lr=0.3",  # a rate that overshoots: the best comes before the end
        "scheduler.warmup_iters=0",
    ]
    trainer = Trainer(validate(load_config(TINY, keys)), world)
    trainer.train()
    with caplog.at_level(logging.INFO):
        trainer.end_summary("finished")
    for lock in trainer.locks:
        lock.release()
    evals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in evals if r.get("event") == "eval"]
    losses = {r["step"]: r["valid_loss"] for r in evals}
    best_step = min(losses, key=lambda s: (losses[s], s))
    best = read_best(run / "checkpoints")
    assert best["step"] == best_step and best["valid_loss"] == losses[best_step]
    kept = sorted(int(p.name[5:]) for p in complete_checkpoints(run / "checkpoints"))
    assert kept == sorted({best_step, 6})  # keep_last=1 pruned every other save
    assert best_step < 6, losses  # this run's rate overshoots, so the protection was exercised
    assert f"step_{best_step:08d} (valid loss {losses[best_step]:.4f}, step {best_step})" in caplog.text


def test_keep_best_needs_evaluation():
    with pytest.raises(ConfigError, match=r"checkpoint.keep_best: .* set train.eval_interval"):
        validate(load_config(TINY, ["checkpoint.keep_best=true", "train.eval_interval=0"]))
