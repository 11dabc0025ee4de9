"""Attention sinks and sliding windows (GPT-OSS) on our sdpa and flex kernels.

The reference is the definition written out: logits, the window/causal/padding mask on global
positions, one extra sink logit per head, softmax, the sink column dropped. Batches are right-
padded with rows of different lengths, and one case holds a context-parallel rank's view: query
chunks 0 and 3 of 4 with all keys gathered in a shuffled order.
"""

from __future__ import annotations

import math

import pytest
import torch

from backend.model.attention.flex import flex_sink_attention
from backend.model.attention.layout import layer_window
from backend.model.attention.masks import allowed_mask, flex_block_mask
from backend.model.attention.sdpa import sdpa_sink_attention

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

B, H, HK, D = 3, 4, 2, 16
LENGTHS = (23, 9, 1)
S = 24


def _reference(q, k, v, q_pos, k_pos, k_valid, window, sinks, scale):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    logits = (q @ k.transpose(-1, -2)) * scale
    allowed = (k_pos[:, None, None, :] <= q_pos[:, None, :, None]) & k_valid[:, None, None, :]
    if window:
        allowed &= k_pos[:, None, None, :] > q_pos[:, None, :, None] - window
    logits = logits.masked_fill(~allowed, -math.inf)
    if sinks is not None:
        logits = torch.cat([logits, sinks[None, :, None, None].expand(*logits.shape[:3], 1)], dim=-1)
    probs = torch.softmax(logits, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # rows with nothing allowed and no sink: zero output
    return probs[..., : k.shape[2]] @ v


def _batch(seed=0, cp_view=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, S, D, generator=g)
    k = torch.randn(B, HK, S, D, generator=g)
    v = torch.randn(B, HK, S, D, generator=g)
    pos = torch.arange(S)[None].expand(B, S).contiguous()
    valid = pos < torch.tensor(LENGTHS)[:, None]
    q_pos, k_pos, k_valid = pos, pos, valid
    if cp_view:  # this rank holds chunks 0 and 3 of 4; keys arrive gathered in a shuffled order
        c = S // 4
        keep = torch.cat([torch.arange(0, c), torch.arange(3 * c, 4 * c)])
        q, q_pos = q[:, :, keep], pos[:, keep]
        perm = torch.randperm(S, generator=g)
        k, v, k_pos, k_valid = k[:, :, perm], v[:, :, perm], pos[:, perm], valid[:, perm]
    sinks = torch.randn(H, generator=g)
    return q, k, v, q_pos, k_pos, k_valid, sinks


CASES = [(w, s, cp) for w in (0, 5) for s in (False, True) for cp in (False, True)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("window,with_sinks,cp_view", CASES)
def test_sdpa_matches_reference_with_gradients(window, with_sinks, cp_view, dtype):
    q, k, v, q_pos, k_pos, k_valid, sinks = (
        t.to(dtype) if t.is_floating_point() else t for t in _batch(cp_view=cp_view)
    )
    sinks = sinks if with_sinks else None
    scale = D**-0.5
    leaves = [t.clone().requires_grad_() for t in (q, k, v)] + ([sinks.clone().requires_grad_()] if with_sinks else [])
    refs = [t.detach().clone().requires_grad_() for t in leaves]
    out = sdpa_sink_attention(
        *leaves[:3], allowed_mask(q_pos, k_pos, k_valid, window), sinks=leaves[3] if with_sinks else None, scale=scale
    )
    ref = _reference(*refs[:3], q_pos, k_pos, k_valid, window, refs[3] if with_sinks else None, scale)
    g = torch.Generator().manual_seed(1)
    upstream = torch.randn(out.shape, generator=g, dtype=dtype)
    (out * upstream).sum().backward()
    (ref * upstream).sum().backward()
    diff = float((out - ref).abs().max())
    grad_diff = max(float((a.grad - b.grad).abs().max()) for a, b in zip(leaves, refs, strict=True))
    print(
        f"{dtype} window={window} sinks={with_sinks} cp={cp_view}: |out diff| {diff:.2e}, |grad diff| {grad_diff:.2e}"
    )
    # FP32: SDPA's fused CPU kernel sums in another order than the reference (gradients are O(1..10)).
    out_tol, grad_tol = (1e-6, 5e-6) if dtype == torch.float32 else (1e-12, 1e-12)
    assert diff <= out_tol and grad_diff <= grad_tol
    assert all(torch.isfinite(t.grad).all() for t in leaves)
    if with_sinks:
        assert float(leaves[3].grad.abs().min()) > 0  # every head's sink is trained


def test_window_and_sinks_change_the_result():
    """The comparisons above have teeth: a window and sinks each move the output."""
    q, k, v, q_pos, k_pos, k_valid, sinks = _batch()
    scale = D**-0.5
    full = sdpa_sink_attention(q, k, v, allowed_mask(q_pos, k_pos, k_valid), scale=scale)
    assert (
        float((sdpa_sink_attention(q, k, v, allowed_mask(q_pos, k_pos, k_valid, 5), scale=scale) - full).abs().max())
        > 0.1
    )
    sunk = sdpa_sink_attention(q, k, v, allowed_mask(q_pos, k_pos, k_valid), sinks=sinks + 2, scale=scale)
    assert float((sunk - full).abs().max()) > 0.1


def test_window_semantics():
    """Key j is allowed for query p iff p - W < j <= p and valid: W keys including itself."""
    pos = torch.arange(8)[None]
    valid = pos < 7
    m = allowed_mask(pos, pos, valid, window=3)[0, 0]
    assert m[5].nonzero().flatten().tolist() == [3, 4, 5]
    assert m[0].nonzero().flatten().tolist() == [0]
    assert m[7].nonzero().flatten().tolist() == [5, 6]  # key 7 is padding
    assert allowed_mask(pos, pos, valid, window=0)[0, 0, 6].sum() == 7


def test_padding_rows_without_keys_stay_finite():
    """A padding query far past its row's end sees no key under a window: zero output, no NaN grads."""
    q, k, v, q_pos, k_pos, k_valid, sinks = _batch()
    for s in (None, sinks.clone().requires_grad_()):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = sdpa_sink_attention(*leaves, allowed_mask(q_pos, k_pos, k_valid, 2), sinks=s, scale=0.25)
        assert float(out[2, :, 5:].abs().max()) == 0.0  # row 2 has one token; queries 5.. see nothing
        out.sum().backward()
        assert all(torch.isfinite(t.grad).all() for t in leaves)


@pytest.mark.parametrize("window,with_sinks,cp_view", CASES)
def test_flex_forward_matches_sdpa(window, with_sinks, cp_view):
    q, k, v, q_pos, k_pos, k_valid, sinks = _batch(seed=2, cp_view=cp_view)
    sinks = sinks if with_sinks else None
    with torch.no_grad():
        a = sdpa_sink_attention(q, k, v, allowed_mask(q_pos, k_pos, k_valid, window), sinks=sinks, scale=0.2)
        b = flex_sink_attention(q, k, v, flex_block_mask(q_pos, k_pos, k_valid, window), sinks=sinks, scale=0.2)
    valid_q = torch.gather(k_valid, 1, torch.argsort(k_pos, 1)).gather(1, q_pos)  # validity of each query
    diff = float((a - b).permute(0, 2, 1, 3)[valid_q].abs().max())
    print(f"flex vs sdpa window={window} sinks={with_sinks} cp={cp_view}: {diff:.2e}")
    assert diff <= 1e-5


def test_matches_transformers_gpt_oss_eager_attention():
    """transformers' GPT-OSS eager attention (sink column, its own sliding-window mask) on valid queries."""
    from transformers import masking_utils as masking
    from transformers.models.gpt_oss import modeling_gpt_oss as modeling

    q, k, v, q_pos, k_pos, k_valid, sinks = _batch(seed=3)
    module = torch.nn.Module()
    module.num_key_value_groups = H // HK
    module.sinks = torch.nn.Parameter(sinks.clone())
    module.training = False
    window = 6
    mask_fn = masking.sliding_window_causal_mask_function(window)
    idx = torch.arange(S)
    hf_allowed = mask_fn(torch.tensor(0), torch.tensor(0), idx[:, None], idx[None, :])  # [s, s]
    hf_allowed = hf_allowed[None, None] & k_valid[:, None, None, :]
    additive = torch.zeros(hf_allowed.shape).masked_fill(~hf_allowed, torch.finfo(torch.float32).min)
    with torch.no_grad():
        ref, _ = modeling.eager_attention_forward(module, q, k, v, additive, scaling=D**-0.5)  # [b, s, h, d]
        ours = sdpa_sink_attention(q, k, v, allowed_mask(q_pos, k_pos, k_valid, window), sinks=sinks, scale=D**-0.5)
        flex = flex_sink_attention(q, k, v, flex_block_mask(q_pos, k_pos, k_valid, window), sinks=sinks, scale=D**-0.5)
    for name, out in (("sdpa", ours), ("flex", flex)):
        diff = float((out.transpose(1, 2) - ref)[k_valid].abs().max())
        print(f"{name} vs transformers GPT-OSS eager: {diff:.2e}")
        assert diff <= 1e-6 if name == "sdpa" else diff <= 1e-5


def test_layer_window_follows_megatron():
    # GPT-OSS: window 128 = (127, 0), every 2nd layer full (layers are 1-based): sliding, full, ...
    assert [layer_window((127, 0), 2, n) for n in range(1, 5)] == [128, 0, 128, 0]
    assert [layer_window((3, 0), [1, 0, 0], n) for n in (1, 2, 3)] == [4, 0, 0]
    assert layer_window(None, 2, 1) == 0 and layer_window((7, 0), None, 2) == 8
    with pytest.raises(ValueError, match="causal"):
        layer_window((7, 7), None, 1)
