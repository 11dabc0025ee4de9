"""Validation loss: one number whatever the plan or the data-parallel size, on held-out samples."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.distributed.harness import run_ranks
from tests.distributed.test_operations import finish, logs, metrics, start

pytestmark = pytest.mark.distributed


def valid_losses(rank: int, world: int):
    from backend.batching import PlanArgs, make_planner
    from backend.config import load_config
    from backend.data.jsonl import InMemoryDataset
    from backend.data.sample import Sample
    from backend.distributed.setup import init_distributed
    from backend.model.factory import build_model
    from backend.train.forward_only import validation_loss

    env = init_distributed(1)
    cfg = load_config(None, ["model.hidden_size=64", "model.num_layers=2", "train.seed=11"])
    model = build_model(cfg, env, tokenizer_vocab=256).model
    rng = np.random.default_rng(5)
    samples = []
    for n in rng.integers(2, 120, size=23):
        mask = (rng.random(n) < 0.8).astype(np.uint8)
        samples.append(Sample(tokens=rng.integers(0, 256, size=n), loss_mask=mask))
    data = InMemoryDataset(samples, source="valid")
    ids = np.arange(len(samples))
    common = dict(dp_size=env.dp_size)
    planners = {
        "fixed_mbs1": make_planner("fixed", PlanArgs(micro_batch_size=1, **common)),
        "fixed_mbs4": make_planner("fixed", PlanArgs(micro_batch_size=4, **common)),
        "dynamic": make_planner("dynamic", PlanArgs(max_tokens_per_gpu=256, **common)),
    }
    return {name: validation_loss(model, data, ids, env, p) for name, p in planners.items()}


def test_valid_loss_is_the_same_for_any_plan_and_dp_size(tmp_path):
    (tmp_path / "dp1").mkdir()
    (tmp_path / "dp2").mkdir()
    one = run_ranks(valid_losses, 1, tmp_path / "dp1")
    two = run_ranks(valid_losses, 2, tmp_path / "dp2")
    ref, tokens = one[0]["fixed_mbs1"]
    assert tokens > 0 and np.isfinite(ref)
    for result in [*one, *two]:
        for name, (loss, count) in result.items():
            assert count == tokens, name
            assert abs(loss - ref) / ref <= 1e-6, (name, loss, ref)


def test_training_logs_valid_loss_on_a_held_out_split(tmp_path):
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": f"document {i} " * (i % 7 + 2)}) + "\n" for i in range(40)))
    run = tmp_path / "run"
    overrides = [
        f"data.path={data}",
        "data.valid_fraction=0.25",
        "train.eval_interval=2",
        "train.global_batch_size=8",
        "train.max_tokens_per_gpu=512",
        "train.train_iters=3",
        "checkpoint.interval=0",
    ]
    assert finish(start(run, "unused", overrides, nproc=1, torchrun=False)) == 0, logs(run)
    rows = metrics(run)
    evals = [r for r in rows if r.get("event") == "eval"]
    assert [r["step"] for r in evals] == [2, 3]
    assert all(np.isfinite(r["valid_loss"]) and r["valid_tokens"] > 0 for r in evals)
    assert "valid_loss" in logs(run)
