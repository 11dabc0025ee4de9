"""The value objective, its metrics and its gradient do not depend on the plan (FP32, CPU), and
equal a plain computation of the clipped value loss from per-sample values.

One window of uneven lengths, planned as fixed micro-batch size 1, dynamic padded and dynamic
packed, at dp 1, dp 2 and dp 1 x cp 2 (real gloo process groups), token and sequence
normalisation: every objective and metric within 1e-6 of the terms' scale of dp 1's fixed
micro-batch size 1 (gradient cosine >= 0.999999), which equals the formula summed in float64.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from backend.distributed.fsdp import full_tensor
from tests.conftest import TINY
from tests.helpers.tolerance import assert_close_by_scale

from .harness import run_ranks

pytestmark = pytest.mark.distributed

WINDOW = 12
PLANS = {
    "fixed1": ["train.dynamic_batch_enable=false", "train.micro_batch_size=1"],
    "padded": ["train.dynamic_batch_enable=true", "train.dynamic_batch_layout=padded", "train.max_tokens_per_gpu=256"],
    "packed": ["train.dynamic_batch_enable=true", "train.dynamic_batch_layout=packed", "train.max_tokens_per_gpu=256"],
}
NORMALIZATIONS = ("token", "sequence")


def _rows(path, seed=5):
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(WINDOW):
            n = int(rng.integers(12, 140))
            p = int(rng.integers(2, n // 3))
            mask = [0] * p + [1] * (n - p)
            returns = [None] * p + rng.normal(0.5, 1.0, n - p).tolist()
            old = [None] * p + rng.normal(0.0, 0.3, n - p).tolist()
            f.write(
                json.dumps(
                    {
                        "input_ids": rng.integers(0, 256, n).tolist(),
                        "loss_mask": mask,
                        "returns": returns,
                        "old_values": old,
                    }
                )
                + "\n"
            )
    return str(path)


def _plain(model, dataset, cfg) -> dict:
    """The window objective from per-sample values in float64, and the terms' absolute scale."""
    from backend.distributed.fsdp import forward_only
    from backend.model.attention import AttentionContext

    c, norm = cfg.loss.value_clip, cfg.loss.normalization
    samples = [dataset[i] for i in range(WINDOW)]
    counts = [s.loss_tokens() for s in samples]
    total_tokens, total_seqs = sum(counts), sum(1 for k in counts if k)
    value = scale = 0.0
    with forward_only(model):
        for s, count in zip(samples, counts):
            n = len(s.tokens)
            tokens, positions = torch.as_tensor(s.tokens[None, :-1]), torch.arange(n - 1)[None]
            valid = torch.ones_like(tokens, dtype=torch.bool)
            v = model(tokens, positions, AttentionContext(positions=positions, valid=valid))[0, :, 0].double()
            for t in range(1, n):
                if not s.loss_mask[t]:
                    continue
                share = 1 / total_tokens if norm == "token" else 1 / (count * total_seqs)
                x, r, o = float(v[t - 1]), float(s.returns[t]), float(s.old_values[t])
                clipped = o + max(-c, min(c, x - o))
                term = 0.5 * max((x - r) ** 2, (clipped - r) ** 2)
                value += share * term
                scale += share * abs(term)
    return {"value": value, "scale": scale}


def _rank(rank: int, world: int, cp: int, rows: str) -> dict | None:
    from backend.config import load_config, validate
    from backend.data.build import build_dataset
    from backend.data.iterator import planner_from_config, window_data
    from backend.data.row_fields import row_fields
    from backend.distributed.setup import init_distributed
    from backend.model.factory import build_model
    from backend.train.step import forward_backward

    env = init_distributed(cp)
    results, model = {}, None
    for norm in NORMALIZATIONS:
        for plan, keys in PLANS.items():
            overrides = [
                f"data.path={rows}",
                "data.max_seq_length=160",
                f"train.global_batch_size={WINDOW}",
                "model.head=value",
                "loss.type=value",
                "loss.value_clip=0.2",
                f"loss.normalization={norm}",
                f"parallel.context_parallel_size={cp}",
                *keys,
            ]
            cfg = validate(load_config(TINY, overrides), world)
            dataset, tok = build_dataset(cfg.data, row_fields(cfg.loss))
            if model is None:
                model = build_model(cfg, env, tokenizer_vocab=tok.vocab_size).model
            planner = planner_from_config(cfg.train, env.dims)
            data = window_data(
                dataset, np.arange(WINDOW), planner, dp_rank=env.dp_rank, cp_rank=env.cp_rank, cp_size=cp
            )
            model.zero_grad(set_to_none=True)
            out = forward_backward(model, data, env, loss_cfg=cfg.loss)
            grad = torch.cat([full_tensor(p.grad).reshape(-1).double() for p in model.parameters()])
            results[(norm, plan)] = {**out, "grad": grad, "mbs": data.plan.num_microbatches}
        if world == 1:
            results[(norm, "plain")] = _plain(model, dataset, cfg)
    return results if rank == 0 else None


@pytest.fixture(scope="module")
def windows(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("value_equivalence")
    rows = _rows(tmp / "rows.jsonl")
    out = {}
    for name, world, cp in (("dp1", 1, 1), ("dp2", 2, 1), ("cp2", 2, 2)):
        (tmp / name).mkdir()
        out[name] = run_ranks(_rank, world, tmp / name, cp, rows, timeout=400)[0]
    return out


@pytest.mark.parametrize("norm", NORMALIZATIONS)
def test_value_objective_is_the_formula_under_every_plan(windows, norm):
    ref = windows["dp1"][(norm, "fixed1")]
    plain = windows["dp1"][(norm, "plain")]
    assert 0 < ref["vf_clipfrac"] < 1  # both clipped and unclipped tokens: not vacuous
    assert_close_by_scale(ref["loss"], plain["value"], plain["scale"], what=f"{norm} objective vs the formula")
    seen = set()
    for topology, results in windows.items():
        for plan in PLANS:
            got = results[(norm, plan)]
            seen.add(got["mbs"])
            assert_close_by_scale(got["loss"], ref["loss"], plain["scale"], what=f"{topology} {plan} loss")
            for key in ("vf_clipfrac", "value_mean", "return_mean", "explained_variance"):
                assert got[key] == pytest.approx(ref[key], rel=1e-6, abs=1e-7), (topology, plan, key)
            cos = float(torch.dot(got["grad"], ref["grad"]) / (got["grad"].norm() * ref["grad"].norm()))
            assert cos >= 0.999999, (topology, plan)
    assert len(seen) >= 2
