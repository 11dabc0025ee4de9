"""The policy objective's per-token terms against a plain-Python statement of the formulas
(DESIGN.md 4b), and the properties users rely on: no gradient through clipped tokens, zero KL
at the reference, NaN at masked positions inert, linear in loss_weight, REINFORCE when detached."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from backend.config.schema import LossConfig
from backend.loss.policy import policy_token_terms, token_scale

POLICY = LossConfig(type="policy")


def reference_token_terms(lp, old, ref, adv, cfg) -> tuple[float, float]:
    """One token's (pg, KL), written from the formulas with Python floats."""
    r = math.exp(max(-cfg.logratio_clamp, min(cfg.logratio_clamp, lp - old)))
    clipped_r = max(1 - cfg.ratio_clip_low, min(1 + cfg.ratio_clip_high, r))
    pg = max(-adv * r, -adv * clipped_r)
    if cfg.dual_clip and adv < 0:
        pg = min(pg, -cfg.dual_clip * adv)
    d = lp - ref
    kl = {"k1": d, "k2": d * d / 2, "k3": math.exp(-d) + d - 1}[cfg.kl_estimator]
    return pg, kl


def reference_token_loss(lp, old, ref, adv, weight, ent, cfg) -> float:
    """One token's l_t, written from the formulas with Python floats."""
    pg, kl = reference_token_terms(lp, old, ref, adv, cfg)
    return weight * (pg + cfg.kl_coef * kl - cfg.entropy_coef * ent)


def _inputs(seed=0, rows=3, length=17):
    g = torch.Generator().manual_seed(seed)
    lp = (-5 + torch.randn(rows, length, generator=g, dtype=torch.float64)).requires_grad_()
    old = lp.detach() + 0.5 * torch.randn(rows, length, generator=g, dtype=torch.float64)
    ref = lp.detach() + 0.3 * torch.randn(rows, length, generator=g, dtype=torch.float64)
    adv = torch.randn(rows, 1, generator=g, dtype=torch.float64).expand(rows, length).clone()
    adv[0, :5] = torch.randn(5, generator=g, dtype=torch.float64)  # a per-token advantage row
    mask = (torch.rand(rows, length, generator=g) > 0.3).to(torch.float64)
    weight = mask * (0.5 + torch.rand(rows, length, generator=g, dtype=torch.float64))
    ent = 3 + torch.rand(rows, length, generator=g, dtype=torch.float64)
    return dict(lp=lp, old=old, ref=ref, adv=adv, mask=mask, weight=weight, ent=ent)


def _terms(x, cfg, **over):
    x = {**x, **over}
    return policy_token_terms(
        x["lp"],
        x["ent"],
        loss_mask=x["mask"],
        loss_weight=x["weight"],
        advantages=x["adv"],
        old_logprobs=x["old"],
        ref_logprobs=x["ref"],
        cfg=cfg,
    )


CONFIGS = [
    POLICY,
    replace(POLICY, ratio_clip_low=0.2, ratio_clip_high=0.28, kl_coef=0.05, kl_estimator="k1"),
    replace(POLICY, dual_clip=3.0, kl_coef=0.1, kl_estimator="k2", entropy_coef=0.01),
    replace(POLICY, kl_coef=0.2, kl_estimator="k3", entropy_coef=0.003, logratio_clamp=0.3),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=["plain", "clip-higher-k1", "dual-k2-entropy", "k3-clamped"])
def test_objective_equals_the_formulas(cfg):
    x = _inputs()
    terms = _terms(x, cfg)
    for i in range(x["lp"].shape[0]):
        for t in range(x["lp"].shape[1]):
            if not x["mask"][i, t]:
                assert terms["objective"][i, t] == 0
                continue
            if cfg.logratio_clamp < 1:  # the clamp also bounds k3's exponent: compare the unclamped tokens only
                if abs(float(x["lp"][i, t] - x["ref"][i, t])) > cfg.logratio_clamp:
                    continue
            want = reference_token_loss(
                *(float(x[k][i, t].detach()) for k in ("lp", "old", "ref", "adv", "weight", "ent")), cfg
            )
            assert float(terms["objective"][i, t]) == pytest.approx(want, rel=1e-12, abs=1e-12)


def test_clipped_tokens_get_no_gradient_and_count_in_clipfrac():
    x = _inputs(1)
    terms = _terms(x, POLICY)
    terms["objective"].sum().backward()
    clipped = terms["clipped"].bool()
    assert clipped.any() and (~clipped & (x["mask"] > 0)).any()
    assert torch.all(x["lp"].grad[clipped] == 0)
    assert torch.all(x["lp"].grad[~clipped & (x["mask"] > 0)] != 0)
    # clipped means: the ratio left the trust region in the direction the advantage pushes
    ratio = terms["ratio"]
    adv = x["adv"]
    expect = ((adv > 0) & (ratio > 1.2)) | ((adv < 0) & (ratio < 0.8))
    assert torch.equal(clipped, expect & (x["mask"] > 0))


def test_dual_clip_caps_negative_advantages_and_stops_their_gradient():
    cfg = replace(POLICY, dual_clip=2.0)
    lp = torch.tensor([[0.0, 0.0, 0.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[0.0, -3.0, -3.0]], dtype=torch.float64)  # ratios 1, e^3, e^3
    adv = torch.tensor([[-1.0, -1.0, 1.0]], dtype=torch.float64)
    ones = torch.ones_like(adv)
    terms = policy_token_terms(
        lp, None, loss_mask=ones, loss_weight=ones, advantages=adv, old_logprobs=old, ref_logprobs=None, cfg=cfg
    )
    assert terms["pg"][0].tolist() == pytest.approx([1.0, 2.0, -1.2])  # min(e^3, 2) for the negative one
    terms["objective"].sum().backward()
    assert lp.grad[0, 1] == 0 and lp.grad[0, 2] == 0 and lp.grad[0, 0] != 0


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_is_zero_at_the_reference(estimator):
    cfg = replace(POLICY, kl_coef=1.0, kl_estimator=estimator)
    x = _inputs(2)
    with_kl = _terms(x, cfg, ref=x["lp"].detach().clone())
    assert torch.all(with_kl["kl"] == 0)
    grad_kl = torch.autograd.grad(with_kl["objective"].sum(), x["lp"])[0]
    grad_pg = torch.autograd.grad(_terms(x, replace(cfg, kl_coef=0.0))["objective"].sum(), x["lp"])[0]
    if estimator == "k1":  # k1's gradient is 1 per token, even at the reference
        assert torch.allclose(grad_kl - grad_pg, x["weight"])
    else:
        assert torch.equal(grad_kl, grad_pg)


def test_nan_at_masked_positions_changes_nothing():
    cfg = replace(POLICY, kl_coef=0.1, entropy_coef=0.01, dual_clip=3.0)
    x = _inputs(3)
    masked = x["mask"] == 0
    poisoned = {k: torch.where(masked, torch.full_like(x[k], float("nan")), x[k]) for k in ("old", "ref", "adv")}
    clean = _terms(x, cfg)
    dirty = _terms(x, cfg, **poisoned)
    g_clean = torch.autograd.grad(clean["objective"].sum(), x["lp"])[0]
    g_dirty = torch.autograd.grad(dirty["objective"].sum(), x["lp"])[0]
    assert torch.equal(clean["objective"], dirty["objective"])
    assert torch.equal(g_clean, g_dirty) and torch.isfinite(g_dirty).all()


def test_loss_and_gradient_scale_with_loss_weight():
    cfg = replace(POLICY, kl_coef=0.1, entropy_coef=0.01)
    x = _inputs(4)
    base = _terms(x, cfg)["objective"].sum()
    g_base = torch.autograd.grad(base, x["lp"])[0]
    scaled = _terms(x, cfg, weight=3.0 * x["weight"])["objective"].sum()
    g_scaled = torch.autograd.grad(scaled, x["lp"])[0]
    assert float(scaled) == pytest.approx(3.0 * float(base), rel=1e-12)
    assert torch.allclose(g_scaled, 3.0 * g_base, rtol=1e-12, atol=0)


def test_detach_is_reinforce():
    """old = lp.detach(): ratio 1, loss -A per token, gradient -A d lp: weighted cross-entropy with weight A."""
    cfg = replace(POLICY, old_logprobs="detach")
    x = _inputs(5)
    terms = _terms(x, cfg, old=None)
    assert torch.all(terms["ratio"][x["mask"] > 0] == 1)
    grad = torch.autograd.grad(terms["objective"].sum(), x["lp"])[0]
    assert torch.allclose(grad, -x["adv"] * x["weight"], rtol=1e-12, atol=0)


def test_token_and_sequence_normalisation():
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 0, 0, 0]], dtype=torch.float32)
    seq = torch.tensor([[3, 3, 3, 3, 3], [2, 2, 2, 2, 2]], dtype=torch.float32)
    tok = token_scale(mask, seq, normalization="token", window_tokens=10, window_sequences=4)
    assert torch.equal(tok, mask / 10)
    per_seq = token_scale(mask, seq, normalization="sequence", window_tokens=10, window_sequences=4)
    assert per_seq[0].tolist() == pytest.approx([0, 1 / 12, 1 / 12, 1 / 12, 0])
    assert per_seq[1].tolist() == pytest.approx([1 / 8, 1 / 8, 0, 0, 0])
    # each sequence's tokens add up to 1 / window_sequences
    assert float(per_seq.sum()) == pytest.approx(2 / 4)
