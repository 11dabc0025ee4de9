#!/usr/bin/env python3
"""How often compiled FlexAttention recompiles over a run, with and without shape buckets (CUDA).

    python tools/bench/flex_compile_count.py [--steps 6] [--max-shapes 4] [--json]

Every distinct (rows, padded length) a microbatch brings is a new shape for ``torch.compile``;
``train.dynamic_batch_max_shapes`` caps the distinct padded lengths. This runs the same windows
(RL-like long tail, up to 2,048 tokens) forward and backward through a one-layer flex model twice,
exact lengths and bucketed, and reports dynamo's compiled-graph count, the recompiles, and the
distinct shapes each saw. Exits 3 without a CUDA device (FlexAttention trains only on CUDA).
"""

from __future__ import annotations

import argparse
import json
import sys


def run(args, max_shapes: int) -> dict:
    import numpy as np
    import torch
    import torch._dynamo
    from torch._dynamo.utils import counters

    from backend.batching import PlanArgs, choose_bucket_edges, make_planner
    from backend.bench.length_sets import synthetic_lengths
    from backend.config import load_config
    from backend.data.collate import collate
    from backend.data.sample import Sample
    from backend.distributed.setup import init_distributed
    from backend.model.factory import build_model
    from backend.model.forward import token_losses

    env = init_distributed(1)
    overrides = ["model.hidden_size=256", "model.num_layers=1", "model.attention_backend=flex"]
    cfg = load_config(None, [*overrides, "data.max_seq_length=2048", "train.precision=bf16"])
    model = build_model(cfg, env, tokenizer_vocab=256).model
    lengths = synthetic_lengths("rl_longtail", 64 * args.steps, seed=1, cap=2048)
    edges = choose_bucket_edges(lengths, max_shapes) if max_shapes else None
    planner = make_planner("dynamic", PlanArgs(dp_size=1, max_tokens_per_gpu=8192, bucket_edges=edges))
    rng = np.random.default_rng(0)
    torch._dynamo.reset()
    counters.clear()
    shapes = set()
    for step in range(args.steps):
        window = lengths[step * 64 : (step + 1) * 64]
        for mb in planner(window).microbatches(0):
            samples = [Sample(tokens=rng.integers(0, 256, size=window[i])) for i in mb.indices]
            batch = collate(samples, list(mb.indices), mb).to(env.device)
            shapes.add(tuple(batch.tokens.shape))
            token_losses(model, batch.tokens, batch.labels, batch.position_ids, batch.valid).sum().backward()
    torch.cuda.synchronize()
    return {
        "max_shapes": max_shapes,
        "distinct_shapes": len(shapes),
        "distinct_lengths": len({s[1] for s in shapes}),
        "unique_graphs": int(counters["stats"]["unique_graphs"]),
        "recompiles": int(sum(counters["recompiles"].values())) if "recompiles" in counters else 0,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--max-shapes", type=int, default=4)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("flex_compile_count: no CUDA device (FlexAttention trains only on CUDA)", file=sys.stderr)
        return 3
    from backend.distributed.setup import shutdown_distributed

    try:
        rows = [run(args, 0), run(args, args.max_shapes)]
    finally:
        shutdown_distributed()
    for r in rows:
        label = f"max_shapes={r['max_shapes']}" if r["max_shapes"] else "exact lengths"
        print(
            f"flex compile: {label:14} {r['distinct_shapes']} shapes ({r['distinct_lengths']} lengths), "
            f"{r['unique_graphs']} compiled graphs, {r['recompiles']} recompiles"
        )
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
