"""The policy objective, its metrics and its gradient do not depend on the plan (FP32, CPU).

One window of uneven lengths, planned as fixed micro-batch size 1, fixed 4, dynamic padded and
dynamic packed, at dp 1, dp 2 and dp 1 x cp 2 (real gloo process groups): every objective,
metric and gradient agrees within 1e-6 (of the terms' scale; gradient cosine >= 0.999999) with
dp 1's fixed micro-batch size 1, and dp 1's objective equals a plain computation of the formulas
from per-sample log-probabilities. Loss settings: token normalisation with clip-higher, dual clip,
k3 KL and an entropy bonus; sequence normalisation with k2; and, on rows carrying the sampler's
log-probabilities, temperature 0.7 with each rollout correction (tis with verl's clamped k3 and
dual clip, icepop, seq_tis under sequence normalisation, seq_mask_tis).
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
    # What the sampler saw (rows carry rollout_logprobs): the sampler's temperature, verl's
    # clamped k3 (low_var_kl) and dual clip, and each correction, token and sequence level.
    "tis": [
        "loss.temperature=0.7",
        "loss.rollout_correction=tis",
        "loss.rollout_correction_cap=1.3",
        "loss.rollout_correction_floor=0.8",
        "loss.dual_clip=3.0",
        "loss.kl_coef=0.05",
        "loss.kl_clamp=10",
    ],
    "icepop": ["loss.temperature=0.7", "loss.rollout_correction=icepop", "loss.rollout_correction_floor=0.8"],
    "seq_tis": ["loss.normalization=sequence", "loss.rollout_correction=seq_tis", "loss.rollout_correction_cap=1.5"],
    "seq_mask_tis": [
        "loss.temperature=0.7",
        "loss.rollout_correction=seq_mask_tis",
        "loss.rollout_correction_floor=0.98",  # a sequence's geometric-mean ratio is 1 +- 0.04 here
        "loss.rollout_correction_cap=1.02",
    ],
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


def _weights(loss, old: list[float], rollout: list[float]) -> tuple[list[float], list[bool]]:
    """The correction's weight and changed flag of each loss token of one sequence, from the
    published formulas (tests/unit/test_rollout_correction.py states them)."""
    method, cap, floor = loss.rollout_correction, loss.rollout_correction_cap, loss.rollout_correction_floor
    d = [o - r for o, r in zip(old, rollout)]
    if method == "none":
        return [1.0] * len(d), [False] * len(d)
    if method == "seq_tis":
        ratio = math.exp(sum(d))
        return [min(ratio, cap)] * len(d), [ratio > cap] * len(d)
    if method == "seq_mask_tis":
        keep = floor <= math.exp(sum(d) / len(d)) <= cap
        return [math.exp(x) if keep else 0.0 for x in d], [not keep] * len(d)
    ratios = [math.exp(x) for x in d]
    if method == "tis":
        return [min(max(r, floor), cap) for r in ratios], [not floor <= r <= cap for r in ratios]
    return [r if floor <= r <= cap else 0.0 for r in ratios], [not floor <= r <= cap for r in ratios]  # icepop


def _plain_objective(model, dataset, cfg) -> dict:
    """The window objective from per-sample log-probabilities and entropies of softmax(logits / T)
    in float64, with the correction weights and clamps of the formulas, summed with Python floats
    (``value``), the mismatch measures, and the scale of each summed quantity (``scale``: the same
    sums over the terms' absolute values), by which FP32 results are judged: the objective cancels
    (0.039 + 0.007 - 0.055 on the token loss) while its terms are of order 0.5, so its rounding is
    relative to the terms."""
    from backend.distributed.fsdp import forward_only
    from backend.model.attention import AttentionContext
    from tests.unit.test_policy_loss import reference_token_terms

    loss = cfg.loss
    samples = [dataset[i] for i in range(WINDOW)]
    counts = [s.loss_tokens() for s in samples]
    total_tokens, total_seqs = sum(counts), sum(1 for c in counts if c)
    value = 0.0
    scale = dict.fromkeys(("loss", "pg_loss", "kl", "entropy", "approx_kl"), 0.0)
    mismatch = dict.fromkeys(("token_mult_prob_error", "rollout_logprob_abs_diff", "rollout_correction_share"), 0.0)
    with forward_only(model):
        for s, count in zip(samples, counts):
            n = len(s.tokens)
            tokens = torch.as_tensor(s.tokens[None, :-1])
            positions = torch.arange(n - 1)[None]
            valid = torch.ones_like(tokens, dtype=torch.bool)
            logits = model(tokens, positions, AttentionContext(positions=positions, valid=valid))[0].double()
            logp = torch.log_softmax(logits / loss.temperature, -1)
            lp = logp.gather(-1, torch.as_tensor(s.tokens[1:])[:, None])[:, 0]
            entropy = -(logp.exp() * logp).sum(-1)
            targets = [t for t in range(1, n) if s.loss_mask[t]]
            old = [float(s.old_logprobs[t]) for t in targets]
            rollout = [float(s.rollout_logprobs[t]) for t in targets] if s.rollout_logprobs is not None else old
            weights, changed = _weights(loss, old, rollout)
            for t, w, c, r in zip(targets, weights, changed, rollout):
                share = 1 / total_tokens if loss.normalization == "token" else 1 / (count * total_seqs)
                x, h = float(lp[t - 1]), float(entropy[t - 1])
                pg, kl = reference_token_terms(
                    x,
                    float(s.old_logprobs[t]),
                    float((s.ref_logprobs if s.ref_logprobs is not None else s.old_logprobs)[t]),  # KL unused then
                    float(s.advantages[t]),
                    loss,
                )
                if loss.kl_clamp:
                    kl = max(-loss.kl_clamp, min(loss.kl_clamp, kl))
                pg *= w
                value += share * (pg + loss.kl_coef * kl - loss.entropy_coef * h)
                scale["loss"] += share * (abs(pg) + loss.kl_coef * abs(kl) + loss.entropy_coef * h)
                scale["pg_loss"] += share * abs(pg)
                scale["kl"] += share * abs(kl)
                scale["entropy"] += share * h
                scale["approx_kl"] += share * abs(float(s.old_logprobs[t]) - x)
                mismatch["token_mult_prob_error"] += share * math.exp(abs(x - r))
                mismatch["rollout_logprob_abs_diff"] += share * abs(x - r)
                mismatch["rollout_correction_share"] += share * c
    return {"value": value, "scale": scale, "mismatch": mismatch}


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
            planner = planner_from_config(cfg.train, env.dims)
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
    rows = str(write_rows(tmp / "rows.jsonl", rl_rows(WINDOW, seed=3, max_len=150, rollout=True)))
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
    assert ref["clipfrac"] > 0 and ref.get("kl", 1) > 0 and ref["ratio_max"] > 1.2  # not vacuous
    # Sums judged by the scale of their terms (tests/helpers/tolerance.py); clipfrac, clipfrac_lower
    # and the corrected share are shares of tokens (terms of 0 or 1), the ratio extremes and the
    # mismatch measures (positive terms, no cancelling) are judged relative to themselves.
    shares = ("clipfrac", "clipfrac_lower", "rollout_correction_share")
    positive = ("token_mult_prob_error", "rollout_logprob_abs_diff", "rollout_kl", "rollout_logprob_abs_diff_max")
    scale = {**windows["dp1"][(loss, "plain")]["scale"], **dict.fromkeys(shares, 1.0)}
    seen_mbs = set()
    for topology, results in windows.items():
        for plan in PLANS:
            got = results[(loss, plan)]
            seen_mbs.add(got["mbs"])
            for key in [k for k in ("loss", "pg_loss", "kl", "entropy", "approx_kl", *shares) if k in ref]:
                assert_close_by_scale(got[key], ref[key], scale[key], what=f"{topology} {plan} {key}")
            for key in ("ratio_min", "ratio_max", *positive):
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
    for key, want in plain["mismatch"].items():
        assert r[key] == pytest.approx(want, rel=1e-5, abs=1e-6), key  # FP32 log-probabilities vs float64
    if loss in ("tis", "icepop", "seq_tis", "seq_mask_tis"):
        assert 0 < r["rollout_correction_share"] < 1  # some tokens changed, some not: not vacuous


def test_metrics_add_up_to_the_objective(windows):
    r = windows["dp2"][("token", "packed")]
    want = r["pg_loss"] + 0.05 * r["kl"] - 0.01 * r["entropy"]
    # FP32 per-token sums vs FP64 metric sums
    assert_close_by_scale(r["loss"], want, windows["dp1"][("token", "plain")]["scale"]["loss"], what="objective")
