"""Faults survived by name: a step that is not finite under train.nonfinite=stop and skip, with
the NaN on one rank only at dp 2 (no hang: the loss and gradient norm are sums over every rank);
a reward that never returns (rl.reward_timeout_s) is in tests/unit/test_rl_loop.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import TINY

from .harness import run_ranks

pytestmark = pytest.mark.distributed


def _nonfinite_run(rank: int, world: int, tmp: str, policy: str, nan_steps: tuple, nan_rank: int, max_skips: int):
    """Train the tiny config 4 steps with a NaN injected into ``nan_rank``'s objective (its gradient) at
    ``nan_steps``; return the error (if any), whether each step changed the weights, and the
    checkpoints on disk."""
    from backend.config import load_config, validate
    from backend.distributed.setup import init_distributed
    from backend.train.step import NonFiniteError
    from backend.train.trainer import Trainer

    env = init_distributed(1)
    cfg = validate(
        load_config(
            TINY,
            [
                f"logger.run_dir={tmp}/run",
                "train.train_iters=4",
                "checkpoint.interval=0",
                "checkpoint.resume=false",
                "logger.log_interval=1000",
                f"train.nonfinite={policy}",
                f"train.nonfinite_max_skips={max_skips}",
            ],
        ),
        world_size=world,
    )
    trainer = Trainer(cfg, env)
    original = trainer.objective.microbatch

    def poisoned(model, mb, data, env_):
        share = original(model, mb, data, env_)
        return share * float("nan") if rank == nan_rank and trainer.step in nan_steps else share

    trainer.objective.microbatch = poisoned
    snapshots = []
    one_step = trainer.train_one_step

    def counted():
        before = [p.detach().clone() for p in trainer.model.parameters()]
        try:
            return one_step()
        finally:
            after = list(trainer.model.parameters())
            snapshots.append(not all(torch.equal(a, b.detach()) for a, b in zip(before, after)))

    trainer.train_one_step = counted
    error = None
    try:
        trainer.train()
    except NonFiniteError as e:
        error = str(e)
    trainer.metrics.close()
    rows = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    ckpts = sorted(p.name for p in (Path(tmp) / "run" / "checkpoints").glob("step_*"))
    return {"error": error, "changed": snapshots, "rows": rows, "checkpoints": ckpts}


def test_stop_at_dp2_with_the_nan_on_one_rank(tmp_path, embedded_cache):
    results = run_ranks(_nonfinite_run, 2, tmp_path, str(tmp_path), "stop", (2,), 1, 10, timeout=300)
    for r in results:  # both ranks stop at step 2, no hang, no update applied there
        assert r["error"] and r["error"].startswith(
            "step 2: non-finite gradient norm (nan); the update was not applied"
        )
        assert "the last good checkpoint is" in r["error"] and "step_00000001 (step 1)" in r["error"]
        assert "optimizer.lr" in r["error"]
        assert r["changed"] == [True, False]
        assert r["checkpoints"] == ["step_00000001"]  # saved then: the interval (0) had not
    rows = results[0]["rows"]
    assert [row["step"] for row in rows] == [1] and rows[0]["nonfinite_steps"] == 0
    meta = json.loads((tmp_path / "run" / "checkpoints" / "step_00000001" / "meta.json").read_text())
    assert meta["step"] == 1 and meta["nonfinite_steps"] == 0


def test_skip_applies_no_update_counts_and_stops_past_the_limit(tmp_path, embedded_cache):
    r = run_ranks(_nonfinite_run, 1, tmp_path, str(tmp_path), "skip", (2, 3), 0, 1, timeout=300)[0]
    assert r["changed"] == [True, False, False]  # steps 2 and 3: no update
    assert [row["step"] for row in r["rows"]] == [1, 2]
    assert r["rows"][1]["nonfinite_steps"] == 1 and r["rows"][0]["nonfinite_steps"] == 0
    assert r["rows"][1]["grad_norm"] != r["rows"][1]["grad_norm"]  # NaN, logged as it was
    assert r["error"].startswith("step 3: 2 steps were not finite, more than train.nonfinite_max_skips=1")
    assert "step_00000002 (step 2)" in r["error"]
