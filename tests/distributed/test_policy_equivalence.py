"""The policy objective, its metrics and its gradient do not depend on the plan (FP32, CPU).

One window of uneven lengths, planned as fixed micro-batch size 1, fixed 4, dynamic padded and
dynamic packed, at dp 1, dp 2 and dp 1 x cp 2 (real gloo process groups): every objective,
metric and gradient agrees within 1e-6 relative (gradient cosine >= 0.999999) with dp 1's fixed
micro-batch size 1, and dp 1's objective equals a plain computation of the formulas from
per-sample log-probabilities. Two loss settings: token normalisation with clip-higher, dual clip,
k3 KL and an entropy bonus; sequence normalisation with k2.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from backend.bench.rl_rows import rl_rows, write_rows
from tests.conftest import TINY
from tests.helpers.tolerance import assert_close_by_scale

from .harness import run_ranks

pytestmark = pytest.mark.distributed

WINDOW = 16
LOSSES = {
    "token": [
        "loss.ratio_clip_high=0.28",
        "loss.dual_clip=3.0",
        "loss.kl_coef=0.05",
        "loss.kl_estimator=k3",
        "loss.entropy_coef=0.01",
    ],
    "sequence": ["loss.normalization=sequence", "loss.kl_coef=0.1", "loss.kl_estimator=k2"],
}
PLANS = {
    "fixed1": ["train.dynamic_batch_enable=false", "train.micro_batch_size=1"],
    "fixed4": ["train.dynamic_batch_enable=false", "train.micro_batch_size=4"],
    "padded": ["train.dynamic_batch_enable=true", "train.dynamic_batch_layout=padded", "train.max_tokens_per_gpu=256"],
    "packed": ["train.dynamic_batch_enable=true", "train.dynamic_batch_layout=packed", "train.max_tokens_per_gpu=256"],
}


def _overrides(rows: str, cp: int, loss: str, plan: str) -> list[str]:
    return [
        f"data.path={rows}",
        "data.max_seq_length=160",
        f"train.global_batch_size={WINDOW}",
        "loss.type=policy",
        f"parallel.context_parallel_size={cp}",
        *LOSSES[loss],
        *PLANS[plan],
    ]


def _full_grad(model) -> torch.Tensor:
    parts = []
    for p in model.parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        parts.append(g.detach().reshape(-1).double().cpu())
    return torch.cat(parts)


def _plain_objective(model, dataset, cfg) -> dict:
    """The window objective from per-sample log-probabilities (megatron-core's cross-entropy
    path) and entropies (softmax of the logits), summed with Python floats (``value``), and the
    scale of each summed quantity (``scale``: the same sums over the terms' absolute values), by
    which FP32 results are judged: the objective cancels (0.039 + 0.007 - 0.055 on the token
    loss) while its terms are of order 0.5, so its rounding is relative to the terms."""
    from backend.distributed.fsdp import forward_only
    from backend.model.attention import AttentionContext
    from backend.model.builder import token_losses
    from tests.unit.test_policy_loss import reference_token_terms

    loss = cfg.loss
    samples = [dataset[i] for i in range(WINDOW)]
    counts = [s.loss_tokens() for s in samples]
    total_tokens, total_seqs = sum(counts), sum(1 for c in counts if c)
    value = 0.0
    scale = dict.fromkeys(("loss", "pg_loss", "kl", "entropy", "approx_kl"), 0.0)
    with forward_only(model):
        for s, count in zip(samples, counts):
            n = len(s.tokens)
            tokens = torch.as_tensor(s.tokens[None, :-1])
            labels = torch.as_tensor(s.tokens[None, 1:])
            positions = torch.arange(n - 1)[None]
            valid = torch.ones_like(tokens, dtype=torch.bool)
            lp = -token_losses(model, tokens, labels, positions, valid)[0].double()
            logits = model(tokens, positions, AttentionContext(positions=positions, valid=valid))[0].double()
            entropy = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
            for t in range(1, n):
                if s.loss_mask[t]:
                    w = 1 / total_tokens if loss.normalization == "token" else 1 / (count * total_seqs)
                    x, old, h = float(lp[t - 1]), float(s.old_logprobs[t]), float(entropy[t - 1])
                    pg, kl = reference_token_terms(x, old, float(s.ref_logprobs[t]), float(s.advantages[t]), loss)
                    value += w * (pg + loss.kl_coef * kl - loss.entropy_coef * h)
                    scale["loss"] += w * (abs(pg) + loss.kl_coef * abs(kl) + loss.entropy_coef * h)
                    scale["pg_loss"] += w * abs(pg)
                    scale["kl"] += w * abs(kl)
                    scale["entropy"] += w * h
                    scale["approx_kl"] += w * abs(old - x)
    return {"value": value, "scale": scale}


def _rank(rank: int, world: int, cp: int, rows: str) -> dict | None:
    from backend.config import load_config, validate
    from backend.data.build import build_dataset
    from backend.data.iterator import StepData, collate_plan, planner_from_config
    from backend.data.row_fields import row_fields
    from backend.distributed.setup import init_distributed
    from backend.model.factory import build_model
    from backend.train.step import forward_backward

    results: dict = {}
    model = None
    for loss in LOSSES:
        for plan in PLANS:
            cfg = validate(load_config(TINY, _overrides(rows, cp, loss, plan)), world)
            env = init_distributed(cp)
            dataset, tok = build_dataset(cfg.data, row_fields(cfg.loss))
            if model is None:
                model = build_model(cfg, env, tokenizer_vocab=tok.vocab_size).model
            ids = np.arange(WINDOW)
            planner = planner_from_config(cfg.train, dp_size=env.dp_size, cp_size=env.cp_size)
            step_plan = planner([int(n) for n in dataset.lengths[ids]])
            data = StepData(
                window_ids=ids,
                plan=step_plan,
                microbatches=collate_plan(
                    dataset, ids, step_plan, dp_rank=env.dp_rank, cp_rank=env.cp_rank, cp_size=env.cp_size
                ),
                global_loss_tokens=int(dataset.loss_token_counts[ids].sum()),
                global_loss_sequences=int(np.count_nonzero(dataset.loss_token_counts[ids])),
            )
            model.zero_grad(set_to_none=True)
            out = forward_backward(model, data, env, loss_cfg=cfg.loss)
            results[(loss, plan)] = {**out, "grad": _full_grad(model), "mbs": step_plan.num_microbatches}
        if world == 1:
            results[(loss, "plain")] = _plain_objective(model, dataset, cfg)
    return results if rank == 0 else None


@pytest.fixture(scope="module")
def windows(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("policy_equivalence")
    rows = str(write_rows(tmp / "rows.jsonl", rl_rows(WINDOW, seed=3, max_len=150)))
    out = {}
    for name, world, cp in (("dp1", 1, 1), ("dp2", 2, 1), ("cp2", 2, 2)):
        (tmp / name).mkdir()
        out[name] = run_ranks(_rank, world, tmp / name, cp, rows, timeout=400)[0]
    return out


def _cos(a, b) -> float:
    return float(torch.dot(a, b) / (a.norm() * b.norm()))


@pytest.mark.parametrize("loss", list(LOSSES))
def test_objective_metrics_and_gradient_are_the_same_under_every_plan(windows, loss):
    ref = windows["dp1"][(loss, "fixed1")]
    assert ref["clipfrac"] > 0 and ref["kl"] > 0 and ref["ratio_max"] > 1.2  # not vacuous
    # Sums judged by the scale of their terms (tests/helpers/tolerance.py); clipfrac is a share
    # of tokens (terms of 0 or 1), the ratio extremes are single values near 1.
    scale = {**windows["dp1"][(loss, "plain")]["scale"], "clipfrac": 1.0}
    seen_mbs = set()
    for topology, results in windows.items():
        for plan in PLANS:
            got = results[(loss, plan)]
            seen_mbs.add(got["mbs"])
            for key in ("loss", "pg_loss", "kl", "entropy", "clipfrac", "approx_kl"):
                assert_close_by_scale(got[key], ref[key], scale[key], what=f"{topology} {plan} {key}")
            for key in ("ratio_min", "ratio_max"):
                assert got[key] == pytest.approx(ref[key], rel=1e-6), (topology, plan, key)
            assert _cos(got["grad"], ref["grad"]) >= 0.999999, (topology, plan)
            assert float((got["grad"] - ref["grad"]).norm() / ref["grad"].norm()) <= 1e-5, (topology, plan)
    assert len(seen_mbs) >= 3  # the plans really differ


@pytest.mark.parametrize("loss", list(LOSSES))
def test_objective_equals_the_plain_formulas(windows, loss):
    r = windows["dp1"][(loss, "fixed1")]
    plain = windows["dp1"][(loss, "plain")]
    assert_close_by_scale(r["loss"], plain["value"], plain["scale"]["loss"], what=f"{loss} objective")
    assert math.isfinite(r["loss"])


def test_metrics_add_up_to_the_objective(windows):
    r = windows["dp2"][("token", "packed")]
    want = r["pg_loss"] + 0.05 * r["kl"] - 0.01 * r["entropy"]
    # FP32 per-token sums vs FP64 metric sums
    assert_close_by_scale(r["loss"], want, windows["dp1"][("token", "plain")]["scale"]["loss"], what="objective")
