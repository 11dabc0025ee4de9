#!/usr/bin/env python3
"""Does the sdpa packed path pay for sum(l_i^2) or for the row's square? Measure it.

One long-tailed packed row (RL-like lengths, up to --cap tokens, --row tokens in all) runs the
per-sequence SDPA path (backend.model.attention.sdpa.sdpa_packed), forward and backward, on
random q/k/v. Beside it: the same row as ONE sequence (sum l^2 = row^2: what a path paying for the
row's square costs) and, for reference, SDPA with the dense (row x row) document mask. The time
ratio packed / one-sequence is printed beside the area ratio sum(l_i^2) / row^2.

    python tools/bench/bench_packed_attention.py [--row 16384] [--cap 4096] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def row_lengths(total: int, cap: int, seed: int) -> list[int]:
    from backend.bench.length_sets import synthetic_lengths

    out, i = [], 0
    while sum(out) < total:
        n = synthetic_lengths("rl_longtail", 1, seed=seed * 100000 + i, cap=cap)[0]
        out.append(min(n, total - sum(out)))
        i += 1
    return out


def context(lengths: list[int]):
    import torch

    from backend.model.attention import AttentionContext

    total = sum(lengths)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    segment_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return AttentionContext(
        positions=positions,
        valid=torch.ones(1, total, dtype=torch.bool),
        segment_ids=segment_ids,
        cu_seqlens=cu,
        cu_seqlens_padded=cu.clone(),
    )


def timed(fn, q, k, v, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):
        for x in (q, k, v):
            x.grad = None
        start = time.perf_counter()
        fn(q, k, v).sum().backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--row", type=int, default=16384, help="tokens in the packed row")
    p.add_argument("--cap", type=int, default=4096, help="longest sequence")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dense", action="store_true", help="also time SDPA with the dense row x row mask")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    import torch
    import torch.nn.functional as F

    from backend.model.attention.masks import dense_mask
    from backend.model.attention.sdpa import sdpa_packed

    torch.manual_seed(args.seed)
    lengths = row_lengths(args.row, args.cap, args.seed)
    total = sum(lengths)
    q, k, v = (torch.randn(1, args.heads, total, args.head_dim, requires_grad=True) for _ in range(3))
    scale = args.head_dim**-0.5
    result = {"row": total, "sequences": len(lengths), "longest": max(lengths)}
    ctx = context(lengths)
    result["packed_s"] = timed(lambda q, k, v: sdpa_packed(q, k, v, ctx, scale), q, k, v, args.repeats)
    one = context([total])
    result["one_sequence_s"] = timed(lambda q, k, v: sdpa_packed(q, k, v, one, scale), q, k, v, args.repeats)
    result["area_ratio"] = sum(n * n for n in lengths) / total**2
    result["time_ratio"] = result["packed_s"] / result["one_sequence_s"]
    if args.dense:
        mask = dense_mask(ctx)
        result["dense_mask_s"] = timed(
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale), q, k, v, args.repeats
        )
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"packed row of {total} tokens, {len(lengths)} sequences (longest {max(lengths)}): "
            f"per-sequence SDPA {result['packed_s'] * 1e3:.1f} ms vs the row as one sequence "
            f"{result['one_sequence_s'] * 1e3:.1f} ms: time ratio {result['time_ratio']:.3f}, "
            f"sum(l_i^2)/row^2 {result['area_ratio']:.3f}"
            + (f"; dense row x row mask {result['dense_mask_s'] * 1e3:.1f} ms" if args.dense else "")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
