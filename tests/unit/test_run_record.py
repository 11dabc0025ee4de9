"""The run directory describes what it holds: a start with nothing left to train changes no file
there (only the lock files say who holds it now); a resume that trains with another config writes
that config and keeps the earlier one as config.before_step_N.yaml."""

from __future__ import annotations

from pathlib import Path

from backend.config import load_config, validate
from backend.train.trainer import Trainer
from tests.conftest import TINY


def _files(run: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(run)): p.read_bytes()
        for p in sorted(run.rglob("*"))
        if p.is_file() and not p.name.startswith(".run.lock")
    }


def _run(world, run: Path, cache: str, *overrides: str) -> Trainer:
    cfg = validate(load_config(TINY, [f"logger.run_dir={run}", f"data.cache_dir={cache}", *overrides]))
    trainer = Trainer(cfg, world)
    try:
        trainer.train()
        trainer.end_summary("finished")
    finally:
        for lock in trainer.locks:
            lock.release()
    return trainer


def test_a_start_with_nothing_to_train_changes_no_file(world, tmp_path, embedded_cache):
    run = tmp_path / "run"
    _run(world, run, embedded_cache, "train.train_iters=1")
    before = _files(run)
    assert "config.yaml" in before and "metrics.jsonl" in before and "world.json" in before
    _run(world, run, embedded_cache, "train.train_iters=1", "train.max_tokens_per_gpu=100")
    assert _files(run) == before


def test_a_resume_with_another_config_keeps_the_earlier_one(world, tmp_path, embedded_cache):
    run = tmp_path / "run"
    _run(world, run, embedded_cache, "train.train_iters=1")
    first = (run / "config.yaml").read_text()
    _run(world, run, embedded_cache, "train.train_iters=2", "train.max_tokens_per_gpu=512")
    assert "max_tokens_per_gpu: 512" in (run / "config.yaml").read_text()
    assert (run / "config.before_step_00000001.yaml").read_text() == first
