"""Packed rows on CPU: the model computes per sequence exactly what padded rows compute; flex's
document mask equals sdpa; per-sequence SDPA equals the dense document mask, at CP 1 and CP 2,
with and without GPT-OSS sliding windows and attention sinks; forward-only log-probabilities
agree between layouts."""

from __future__ import annotations

import pytest

from .harness import run_ranks

pytestmark = pytest.mark.distributed

LENGTHS = (5, 37, 1, 64, 12, 90, 3, 33)


def _kernel_vs_dense(ctx, rng_seed: int, *, heads: int = 4, kv_heads: int = 2, dim: int = 8) -> float:
    """sdpa_packed against SDPA under the dense document mask, on random q/k/v (real queries)."""
    import torch
    import torch.nn.functional as F

    from backend.model.attention import gather_cp
    from backend.model.attention.masks import dense_mask
    from backend.model.attention.sdpa import sdpa_packed

    g = torch.Generator().manual_seed(rng_seed)
    s = ctx.positions.shape[1]
    q = torch.randn(1, heads, s, dim, generator=g)
    k = torch.randn(1, kv_heads, s, dim, generator=g)
    v = torch.randn(1, kv_heads, s, dim, generator=g)
    kg = gather_cp(k.permute(2, 0, 1, 3), ctx.cp_group).permute(1, 2, 0, 3)
    vg = gather_cp(v.permute(2, 0, 1, 3), ctx.cp_group).permute(1, 2, 0, 3)
    ours = sdpa_packed(q, kg, vg, ctx, 0.3)
    ref = F.scaled_dot_product_attention(q, kg, vg, attn_mask=dense_mask(ctx), scale=0.3, enable_gqa=True)
    real = ctx.valid[0]
    return float((ours - ref)[:, :, real].abs().max())


def _sinks_windows_vs_dense(ctx, rng_seed: int, window: int, *, heads: int = 4, kv_heads: int = 2, dim: int = 8):
    """Packed sdpa and flex with a window and sinks against the dense document mask restricted to
    the window, with the sink column (``sdpa_sink_attention`` on the whole row): (sdpa, flex) diffs."""
    import torch

    from backend.model.attention import gather_cp
    from backend.model.attention.flex import flex_attention_kernel
    from backend.model.attention.masks import dense_mask
    from backend.model.attention.sdpa import sdpa_attention, sdpa_sink_attention

    g = torch.Generator().manual_seed(rng_seed)
    s = ctx.positions.shape[1]
    q = torch.randn(1, heads, s, dim, generator=g)
    k = torch.randn(1, kv_heads, s, dim, generator=g)
    v = torch.randn(1, kv_heads, s, dim, generator=g)
    sinks = torch.randn(heads, generator=g)
    kg = gather_cp(k.permute(2, 0, 1, 3), ctx.cp_group).permute(1, 2, 0, 3)
    vg = gather_cp(v.permute(2, 0, 1, 3), ctx.cp_group).permute(1, 2, 0, 3)
    allowed = dense_mask(ctx)
    if window:
        kpos, _ = ctx.key_positions()
        allowed = allowed & (kpos[:, None, None, :] > ctx.positions[:, None, :, None] - window)
    ref = sdpa_sink_attention(q, kg, vg, allowed, sinks=sinks, scale=0.3)
    real = ctx.valid[0]
    ours = sdpa_attention(q, kg, vg, ctx, 0.3, window=window, sinks=sinks)
    flex = flex_attention_kernel(q, kg, vg, ctx, 0.3, window=window, sinks=sinks)
    return float((ours - ref)[:, :, real].abs().max()), float((flex - ref)[:, :, real].abs().max())


def _context(batch, cp_group=None):
    from backend.model.attention import AttentionContext

    return AttentionContext(
        positions=batch.position_ids,
        valid=batch.valid,
        cp_group=cp_group,
        segment_ids=batch.segment_ids,
        cu_seqlens=batch.cu_seqlens,
        cu_seqlens_padded=batch.cu_seqlens_padded,
    )


def dp_checks(rank: int, world: int):
    import numpy as np
    import torch

    from backend.batching import Microbatch, PlanArgs, make_planner
    from backend.config import load_config
    from backend.data.collate import collate
    from backend.data.sample import Sample
    from backend.distributed.setup import init_distributed
    from backend.loss.outputs import microbatch_token_losses
    from backend.model.factory import build_model
    from backend.train.forward_only import compute_logprobs

    env = init_distributed(1)
    base = ["model.hidden_size=64", "model.num_layers=2", "data.max_seq_length=256", "train.seed=7"]
    rng = np.random.default_rng(0)
    samples = [Sample(tokens=rng.integers(0, 256, size=n)) for n in LENGTHS]
    ids = list(range(len(samples)))

    def build(backend):
        cfg = load_config(None, [*base, f"model.attention_backend={backend}"])
        return build_model(cfg, env, tokenizer_vocab=256, training=False).model

    out = {}
    sdpa, flex = build("sdpa"), build("flex")
    with torch.no_grad():
        padded = collate(samples, ids, Microbatch(tuple(ids), 96, 0, 0))
        row = sum(LENGTHS) + 9  # tail padding joins the last sequence
        packed = collate(samples, ids, Microbatch(tuple(ids), row, row, 0, packed=True))
        assert packed.tokens.shape == (1, row)
        by_padded = microbatch_token_losses(sdpa, padded)
        by_packed = microbatch_token_losses(sdpa, packed)
        by_flex = microbatch_token_losses(flex, packed)
        offsets = packed.cu_seqlens_padded.tolist()
        out["packed_vs_padded"] = max(
            float((by_packed[0, o : o + n - 1] - by_padded[i, : n - 1]).abs().amax(dim=0, keepdim=True).sum())
            if n > 1
            else 0.0
            for i, (o, n) in enumerate(zip(offsets, LENGTHS))
        )
        out["flex_vs_sdpa"] = float((by_flex - by_packed)[packed.valid].abs().max())
        out["kernel_vs_dense"] = _kernel_vs_dense(_context(packed), 1)
        out["sinks_windows_vs_dense"] = [_sinks_windows_vs_dense(_context(packed), 3, w) for w in (0, 1, 16)]

    model = build("sdpa")
    logprobs = {}
    for layout in ("padded", "packed"):
        planner = make_planner("dynamic", PlanArgs(dp_size=env.dp_size, max_tokens_per_gpu=128, layout=layout))
        logprobs[layout] = compute_logprobs(model, samples, env, planner)
    out["logprob_lengths"] = [len(x) for x in logprobs["packed"]]
    out["logprob_diff"] = max(
        float(np.abs(a - b).max(initial=0.0)) for a, b in zip(logprobs["padded"], logprobs["packed"])
    )
    return out


def cp_checks(rank: int, world: int):
    import numpy as np
    import torch

    from backend.batching import Microbatch, PlanArgs, make_planner, round_up
    from backend.config import load_config
    from backend.data.collate import collate
    from backend.data.sample import Sample
    from backend.distributed.setup import init_distributed
    from backend.model.factory import build_model
    from backend.train.forward_only import compute_logprobs

    env = init_distributed(2)  # one DP rank, CP 2
    rng = np.random.default_rng(0)
    samples = [Sample(tokens=rng.integers(0, 256, size=n)) for n in LENGTHS]
    ids = list(range(len(samples)))
    row = sum(round_up(n, 4) for n in LENGTHS) + 8
    batch = collate(samples, ids, Microbatch(tuple(ids), row, row // 2, 0, packed=True), cp_rank=env.cp_rank, cp_size=2)
    out = {"local_len": batch.tokens.shape[1], "kernel_vs_dense": _kernel_vs_dense(_context(batch, env.cp_group), 2)}
    out["sinks_windows_vs_dense"] = [_sinks_windows_vs_dense(_context(batch, env.cp_group), 4, w) for w in (0, 1, 16)]
    cfg = load_config(None, ["model.hidden_size=64", "model.num_layers=2", "data.max_seq_length=256", "train.seed=7"])
    model = build_model(cfg, env, tokenizer_vocab=256, training=False).model
    with torch.no_grad():
        logprobs = {}
        for layout in ("padded", "packed"):
            planner = make_planner("dynamic", PlanArgs(dp_size=1, cp_size=2, max_tokens_per_gpu=96, layout=layout))
            logprobs[layout] = compute_logprobs(model, samples, env, planner)
    out["logprob_diff"] = max(
        float(np.abs(a - b).max(initial=0.0)) for a, b in zip(logprobs["padded"], logprobs["packed"])
    )
    out["row"] = row
    return out


@pytest.fixture(scope="module")
def dp_results(tmp_path_factory):
    return run_ranks(dp_checks, 2, tmp_path_factory.mktemp("packed_dp"))


@pytest.fixture(scope="module")
def cp_results(tmp_path_factory):
    return run_ranks(cp_checks, 2, tmp_path_factory.mktemp("packed_cp"))


def test_packed_row_equals_padded_rows_and_flex_equals_sdpa(dp_results):
    for r in dp_results:
        assert r["packed_vs_padded"] <= 1e-5
        assert r["flex_vs_sdpa"] <= 1e-5
        assert r["kernel_vs_dense"] <= 1e-5
        assert all(sdpa <= 1e-5 and flex <= 1e-5 for sdpa, flex in r["sinks_windows_vs_dense"]), r


def test_packed_logprobs_equal_padded_logprobs(dp_results):
    for r in dp_results:
        assert r["logprob_lengths"] == [n - 1 for n in LENGTHS]
        assert r["logprob_diff"] <= 1e-5


def test_packed_under_cp2_equals_the_dense_document_mask(cp_results):
    for r in cp_results:
        assert r["local_len"] == r["row"] // 2
        assert r["kernel_vs_dense"] <= 1e-5
        assert all(sdpa <= 1e-5 and flex <= 1e-5 for sdpa, flex in r["sinks_windows_vs_dense"]), r
        assert r["logprob_diff"] <= 1e-5
