"""Activation recomputation (``model.recompute_granularity``) changes memory, never values.

Two steps of the tiny model through the real trainer (FSDP2, dynamic batching, SDPA on CPU)
with none, selective and full recomputation: the same losses, gradient norms and final weights,
bit for bit, under the same parameter names; full recomputation peaks lower. The probe's side
(recomputation lowers b or c and the budget still holds) is in test_memory_budget.
"""

from __future__ import annotations

import pytest
import torch

from backend.distributed.fsdp import full_tensor
from tests.helpers.in_process import train_in_process


def train(world, tmp_path, recompute: str):
    run = tmp_path / recompute
    overrides = [
        "train.dynamic_batch_enable=true",
        "train.max_tokens_per_gpu=512",
        "data.max_seq_length=256",
        "train.train_iters=2",
        f"model.recompute_granularity={recompute}",
        f"checkpoint.dir={run / 'ckpt'}",
    ]
    rows, trainer = train_in_process(world, run / "run", overrides)
    weights = {name: full_tensor(p.detach()).clone() for name, p in trainer.model.named_parameters()}
    return rows, weights


@pytest.fixture(scope="module")
def baseline(world, tmp_path_factory):
    return train(world, tmp_path_factory.mktemp("recompute"), "none")


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recomputation_changes_memory_not_values(world, tmp_path, baseline, recompute):
    rows, weights = train(world, tmp_path, recompute)
    base_rows, base_weights = baseline
    assert [(r["loss"], r["grad_norm"]) for r in rows] == [(r["loss"], r["grad_norm"]) for r in base_rows]
    assert list(weights) == list(base_weights)  # same names: checkpoints and HF maps unchanged
    assert all(torch.equal(weights[name], base_weights[name]) for name in weights)
    if recompute == "full":
        assert max(r["peak_memory_bytes"] for r in rows) < 0.8 * max(r["peak_memory_bytes"] for r in base_rows)
