"""What the sampler saw, per token, against the published formulas written here with Python floats:

- the four corrections (tis, icepop, seq_tis, seq_mask_tis) as verl's ``rollout_corr_helper.py``,
  NeMo-RL's ``ClippedPGLossFn`` and OpenRLHF's ``PolicyLoss`` define them, with the same weights
  whether a sequence is a padded row or a packed segment;
- the mismatch measures (NeMo-RL's token_mult_prob_error, |diff|, k3);
- rollout log-probabilities equal to the old ones: every weight 1 and the objective bitwise the
  uncorrected one, every mismatch measure at its no-mismatch value;
- verl's low_var_kl clamp and pg_clipfrac_lower;
- the temperature divides the logits before the log-softmax and the entropy.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from backend.batching import Microbatch
from backend.config.schema import LossConfig
from backend.data.collate import collate
from backend.data.sample import Sample
from backend.loss.outputs import sequence_sum
from backend.loss.policy import kl_penalty, policy_token_terms
from backend.loss.rollout import correction_weights, mismatch_terms

CAP, FLOOR = 1.5, 0.7


def _rows(seed=0, rows=4, length=12):
    g = np.random.default_rng(seed)
    lengths = [12, 7, 10, 4][:rows]
    mask = np.zeros((rows, length), dtype=bool)
    for r, n in enumerate(lengths):
        mask[r, 2 : n - 1] = g.random(n - 3) > 0.2  # targets 2 .. n-2, some masked
    old = -3 + g.normal(size=(rows, length))
    rollout = old + g.normal(0, 0.4, size=(rows, length))
    rollout[0] = old[0] - 0.3 + 0.4 * g.normal(size=length)  # a sampler below the trainer: d > 0 on average
    rollout[1] = old[1] + 0.02 * g.normal(size=length)  # one sequence close to the trainer's
    rollout[2] = old[2] - 0.6  # a sequence far off: its geometric-mean ratio 1.8 is out of [0.7, 1.5]
    return mask, old, rollout, lengths


def _expected(method, d, mask):
    """Per-position weights and changed flags, from the formulas (module docstring of loss/rollout)."""
    rows, length = d.shape
    w = np.ones_like(d)
    changed = np.zeros_like(mask)
    for r in range(rows):
        tokens = [t for t in range(length) if mask[r, t]]
        total = sum(float(d[r, t]) for t in tokens)
        geo = math.exp(total / max(1, len(tokens)))
        for t in tokens:
            ratio = math.exp(float(d[r, t]))
            if method == "tis":
                w[r, t], changed[r, t] = min(max(ratio, FLOOR), CAP), not FLOOR <= ratio <= CAP
            elif method == "icepop":
                w[r, t], changed[r, t] = (ratio, False) if FLOOR <= ratio <= CAP else (0.0, True)
            elif method == "seq_tis":
                w[r, t], changed[r, t] = min(math.exp(total), CAP), math.exp(total) > CAP
            else:  # seq_mask_tis: the token's own ratio, kept where the sequence's geometric mean is in bounds
                w[r, t], changed[r, t] = (ratio, False) if FLOOR <= geo <= CAP else (0.0, True)
    return w, changed


def _padded_sum(x):
    return x.sum(dim=1, keepdim=True).expand_as(x)


@pytest.mark.parametrize("method", ["tis", "icepop", "seq_tis", "seq_mask_tis"])
def test_each_correction_is_the_published_formula(method):
    mask, old, rollout, _ = _rows()
    d = torch.tensor(old - rollout)
    used = torch.tensor(mask)
    w, changed = correction_weights(d, used, method=method, cap=CAP, floor=FLOOR, sequence_sum=_padded_sum)
    want_w, want_changed = _expected(method, old - rollout, mask)
    assert torch.allclose(w, torch.tensor(want_w), rtol=1e-12, atol=0)
    assert torch.equal(changed, torch.tensor(want_changed))
    assert 0 < int(changed.sum()) < int(used.sum())  # both kinds of token: not vacuous


@pytest.mark.parametrize("method", ["seq_tis", "seq_mask_tis"])
def test_sequence_corrections_are_the_same_padded_and_packed(method):
    """The same sequences as padded rows and as one packed row: the same weight on every token."""
    mask, old, rollout, lengths = _rows(seed=1)
    samples = [
        Sample(
            tokens=np.arange(1, n + 1),
            loss_mask=np.concatenate([[0], mask[r, : n - 1]]).astype(np.uint8),
            old_logprobs=np.concatenate([[0], old[r, : n - 1]]).astype(np.float32),
            rollout_logprobs=np.concatenate([[0], rollout[r, : n - 1]]).astype(np.float32),
        )
        for r, n in enumerate(lengths)
    ]
    ids = list(range(len(samples)))
    padded = collate(samples, ids, Microbatch(tuple(ids), max(lengths), 0, 0))
    packed = collate(samples, ids, Microbatch(tuple(ids), sum(lengths), 0, 0, packed=True))
    weights = {}
    for name, mb in (("padded", padded), ("packed", packed)):
        used = mb.loss_mask > 0
        d = torch.where(used, mb.old_logprobs - mb.rollout_logprobs, torch.zeros_like(mb.old_logprobs))
        w, _ = correction_weights(d, used, method=method, cap=CAP, floor=FLOOR, sequence_sum=sequence_sum(mb))
        weights[name] = w
    offset = 0
    for r, n in enumerate(lengths):
        assert torch.equal(weights["padded"][r, : n - 1], weights["packed"][0, offset : offset + n - 1])
        offset += n


def test_mismatch_measures_are_the_published_formulas():
    mask, old, rollout, _ = _rows(seed=2)
    terms = mismatch_terms(torch.tensor(old), torch.tensor(rollout), torch.tensor(mask))
    for r, t in zip(*np.nonzero(mask)):
        x = float(old[r, t] - rollout[r, t])
        assert float(terms["token_mult_prob_error"][r, t]) == pytest.approx(math.exp(abs(x)), rel=1e-12)
        assert float(terms["rollout_logprob_abs_diff"][r, t]) == pytest.approx(abs(x), rel=1e-12)
        assert float(terms["rollout_kl"][r, t]) == pytest.approx(math.exp(x) - x - 1, rel=1e-9, abs=1e-15)
    assert float(terms["rollout_kl"][~torch.tensor(mask)].abs().max()) == 0.0


def _terms(cfg, lp, old, rollout, mask, adv):
    return policy_token_terms(
        lp,
        None,
        loss_mask=torch.tensor(mask, dtype=torch.float64),
        loss_weight=torch.tensor(mask, dtype=torch.float64),
        advantages=adv,
        old_logprobs=old,
        ref_logprobs=None,
        cfg=cfg,
        rollout_logprobs=rollout,
        sequence_sum=_padded_sum,
    )


@pytest.mark.parametrize("method", ["tis", "icepop", "seq_tis", "seq_mask_tis"])
def test_rollout_equal_to_old_changes_nothing(method):
    mask, old, _, _ = _rows(seed=3)
    g = torch.Generator().manual_seed(0)
    lp = torch.tensor(old) + 0.1 * torch.randn(old.shape, generator=g, dtype=torch.float64)
    adv = torch.randn(old.shape, generator=g, dtype=torch.float64)
    base = LossConfig(type="policy", ratio_clip_high=0.28, dual_clip=3.0)
    plain = _terms(base, lp, torch.tensor(old), None, mask, adv)
    corrected = _terms(
        LossConfig(**{**vars(base), "rollout_correction": method, "rollout_correction_floor": 0.5}),
        lp,
        torch.tensor(old),
        torch.tensor(old),  # the sampler's numbers are the old ones
        mask,
        adv,
    )
    assert torch.equal(plain["objective"], corrected["objective"])  # every weight exactly 1
    assert float(corrected["rollout_correction_share"].sum()) == 0.0
    same = _terms(base, lp, torch.tensor(old), lp.detach(), mask, adv)  # the sampler's are the trainer's own
    used = torch.tensor(mask)
    assert float(same["rollout_logprob_abs_diff"].abs().max()) == 0.0 and float(same["rollout_kl"].abs().max()) == 0.0
    assert torch.equal(same["token_mult_prob_error"][used], torch.ones(int(used.sum()), dtype=torch.float64))


def test_old_logprobs_rollout_uses_the_samplers_numbers():
    mask, old, rollout, _ = _rows(seed=4)
    lp = torch.tensor(old)
    adv = torch.ones(old.shape, dtype=torch.float64)
    cfg = LossConfig(type="policy", old_logprobs="rollout")
    terms = _terms(cfg, lp, None, torch.tensor(rollout), mask, adv)
    used = torch.tensor(mask)
    want = torch.exp(torch.tensor(old - rollout).clamp(-20, 20))[used]
    assert torch.allclose(terms["ratio"][used], want, rtol=1e-12)


def test_verl_low_var_kl_clamp_and_clipfrac_lower():
    lp = torch.tensor([[-1.0, -2.0, -15.0, -0.5]], dtype=torch.float64)
    ref = torch.tensor([[-1.2, -14.0, -0.1, -0.5]], dtype=torch.float64)
    clamped = kl_penalty(lp, ref, "k3", 20.0, 10.0)
    for t in range(4):
        x = max(-20.0, min(20.0, float(ref[0, t] - lp[0, t])))
        assert float(clamped[0, t]) == pytest.approx(max(-10.0, min(10.0, math.exp(x) - x - 1)), rel=1e-12)
    assert float(clamped.max()) == 10.0  # exp(14.9) - 14.9 - 1 clamped, as verl's low_var_kl
    # pg_clipfrac_lower: tokens with A < 0 whose clipped loss exceeds the dual-clip bound -c A
    cfg = LossConfig(type="policy", dual_clip=3.0)
    lp = torch.log(torch.tensor([[5.0, 0.5, 5.0, 1.0]], dtype=torch.float64))
    adv = torch.tensor([[-1.0, -1.0, 1.0, -1.0]], dtype=torch.float64)
    mask = np.ones((1, 4), dtype=bool)
    terms = _terms(cfg, lp, torch.zeros_like(lp), None, mask, adv)
    assert terms["clipped_lower"].tolist() == [[1.0, 0.0, 0.0, 0.0]]  # r = 5 > c = 3 with A < 0 only
    assert float(terms["pg"][0, 0]) == 3.0


def test_temperature_divides_the_logits_before_log_softmax_and_entropy():
    from backend.model import forward as builder

    logits = torch.randn(2, 5, 11, dtype=torch.float32, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(1))
    original = builder.token_logits
    builder.token_logits = lambda *a, **k: logits  # the model's output, fixed
    try:
        for t in (1.0, 0.7):
            lp, h = builder.token_logprobs(None, None, labels, None, None, entropy="value", temperature=t)
            want = torch.log_softmax(logits / t, -1)
            assert torch.allclose(lp, want.gather(-1, labels[..., None])[..., 0], atol=1e-6)
            assert torch.allclose(h, -(want.exp() * want).sum(-1), atol=1e-5)
        one, _ = builder.token_logprobs(None, None, labels, None, None)
        assert torch.equal(one, builder.token_logprobs(None, None, labels, None, None, temperature=1.0)[0])
    finally:
        builder.token_logits = original
