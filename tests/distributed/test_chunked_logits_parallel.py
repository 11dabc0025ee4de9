"""Chunked logits under data and context parallelism (real gloo ranks): dp 2 with padded rows and
dp 1 x cp 2 with packed rows give the unchunked policy objective, metrics and gradient (entropy
bonus in the loss, temperature 0.7) within FP32 rounding, with a chunk size that divides nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from backend.bench.rl_rows import rl_rows, write_rows
from backend.distributed.fsdp import full_tensor
from tests.conftest import TINY

from .harness import run_ranks

pytestmark = pytest.mark.distributed

WINDOW = 10


def _rank(rank: int, world: int, cp: int, layout: str, rows: str) -> dict | None:
    from backend.config import load_config, validate
    from backend.data.build import build_dataset
    from backend.data.iterator import planner_from_config, window_data
    from backend.data.row_fields import row_fields
    from backend.distributed.setup import init_distributed
    from backend.model.factory import build_model
    from backend.train.step import forward_backward

    env = init_distributed(cp)
    out = {}
    for chunk in (0, 7):
        cfg = validate(
            load_config(
                TINY,
                [
                    f"data.path={rows}",
                    "data.max_seq_length=160",
                    f"train.global_batch_size={WINDOW}",
                    "loss.type=policy",
                    "loss.entropy_coef=0.01",
                    "loss.kl_coef=0.05",
                    "loss.temperature=0.7",
                    f"parallel.context_parallel_size={cp}",
                    "train.dynamic_batch_enable=true",
                    f"train.dynamic_batch_layout={layout}",
                    "train.max_tokens_per_gpu=256",
                    f"model.logits_chunk_tokens={chunk}",
                    "model.tie_embeddings=false",
                ],
            ),
            world,
        )
        dataset, tok = build_dataset(cfg.data, row_fields(cfg.loss))
        model = build_model(cfg, env, tokenizer_vocab=tok.vocab_size).model
        planner = planner_from_config(cfg.train, env.dims)
        data = window_data(dataset, np.arange(WINDOW), planner, dp_rank=env.dp_rank, cp_rank=env.cp_rank, cp_size=cp)
        metrics = forward_backward(model, data, env, loss_cfg=cfg.loss)
        grad = torch.cat([full_tensor(p.grad).reshape(-1).double() for p in model.parameters()])
        out[chunk] = {**metrics, "grad": grad, "mbs": data.plan.num_microbatches}
    return out if rank == 0 else None


@pytest.mark.parametrize("cp, layout", [(1, "padded"), (2, "packed")])
def test_chunked_logits_match_under_dp_and_cp(tmp_path, cp, layout):
    rows = str(write_rows(tmp_path / "rows.jsonl", rl_rows(WINDOW, seed=8, max_len=150)))
    result = run_ranks(_rank, 2, tmp_path, cp, layout, rows, timeout=400)[0]
    whole, chunked = result[0], result[7]
    assert whole["mbs"] >= 2
    for key in ("loss", "pg_loss", "kl", "entropy", "clipfrac", "ratio_max"):
        scale = abs(whole["pg_loss"]) + abs(whole["entropy"]) if key == "loss" else abs(whole[key])
        assert abs(chunked[key] - whole[key]) <= 1e-6 * max(scale, 1e-12), key
    cos = float(torch.dot(whole["grad"], chunked["grad"]) / (whole["grad"].norm() * chunked["grad"].norm()))
    assert cos >= 0.999999 and float((whole["grad"] - chunked["grad"]).norm() / whole["grad"].norm()) <= 1e-5
