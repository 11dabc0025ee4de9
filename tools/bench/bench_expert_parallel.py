#!/usr/bin/env python3
"""One MoE layer at expert parallel size 1, 2 and 4 on one gloo world: bytes moved and time per step.

Each arm builds the same one-layer GPT-OSS-shaped model (``build_model``: FSDP2, and at EP > 1
the experts split over EP ranks with their tokens exchanged by all-to-all) from the same seed and
runs forward + backward of one microbatch per rank, each rank its own token count (as dynamic
batching gives them: ``--tokens`` x (1 + rank / world)). Every collective the step issues is
counted by kind on each rank (bytes handed to it: FSDP2's all-gathers of weights and
reduce-scatters of gradients, the experts' all-to-alls of tokens), then the median step time
(slowest rank) and the bytes of the busiest rank are printed side by side, with the experts each
rank computes with. Defaults: GPT-OSS-20B's MoE layer (hidden 2880, 32 experts, top 4, inner
2880) scaled by ``--scale``, FP32 on CPU.

    python tools/bench/bench_expert_parallel.py [--nproc 4] [--eps 1,2,4] [--tokens 512] [--scale 0.125] [--steps 5] [--json]

On CPU and gloo the times say little about a GPU (no NVLink, 2 cores shared by 4 ranks); the
bytes are what the layer moves on any transport.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# torch.distributed's names (2.13 calls FSDP2's all_gather_single / reduce_scatter_single) -> kind.
COLLECTIVES = {
    "all_gather_single": "gather",
    "all_gather_into_tensor": "gather",
    "reduce_scatter_single": "scatter",
    "reduce_scatter_tensor": "scatter",
    "all_to_all_single": "a2a",
}
KINDS = ("gather", "scatter", "a2a")
ARGS_VARIABLE = "BENCH_EXPERT_PARALLEL_ARGS"


def _count_collectives(counts: dict) -> None:
    """Wrap torch.distributed's collectives so every call adds its bytes to ``counts`` (the larger
    of output and input: the whole gathered tensor, the whole gradient before its scatter)."""
    import torch.distributed as dist

    for name, kind in COLLECTIVES.items():
        original = getattr(dist, name, None)
        if original is None:
            continue

        def counted(output, input, *args, _original=original, _kind=kind, **kwargs):
            size = max(output.numel() * output.element_size(), input.numel() * input.element_size())
            counts[_kind] = counts.get(_kind, 0) + size
            return _original(output, input, *args, **kwargs)

        setattr(dist, name, counted)


def _overrides(args) -> list[str]:
    hidden = max(64, int(2880 * args.scale) // 64 * 64)
    return [
        "model.num_layers=1",
        f"model.hidden_size={hidden}",
        "model.num_attention_heads=8",
        "model.num_query_groups=8",
        f"model.num_moe_experts={args.experts}",
        f"model.moe_router_topk={args.topk}",
        f"model.moe_ffn_hidden_size={hidden}",
        "model.attention_backend=sdpa",
        "train.precision=fp32",
        "data.tokenizer=byte",
        f"data.max_seq_length={2 * args.tokens}",
    ]


def _arm(args, ep: int, counts: dict) -> dict:
    import torch

    from backend.bench.compare import watch_experts_held
    from backend.config import load_config, validate
    from backend.distributed.collectives import all_gather_objects, dist_max
    from backend.distributed.setup import init_distributed
    from backend.model import moe_stats
    from backend.model.factory import build_model
    from backend.model.forward import token_losses

    env = init_distributed(1, ep_size=ep)
    cfg = validate(load_config(None, [*_overrides(args), f"parallel.expert_parallel_size={ep}"]), env.world_size)
    model = build_model(cfg, env, tokenizer_vocab=256).model
    held = watch_experts_held(model)
    n = int(args.tokens * (1 + env.rank / env.world_size))
    g = torch.Generator().manual_seed(env.rank)
    tokens = torch.randint(0, 256, (1, n), generator=g)
    positions = torch.arange(n)[None]
    valid = torch.ones(1, n, dtype=torch.bool)
    times = []
    for step in range(args.steps + 1):  # the first is a warm-up
        model.zero_grad(set_to_none=True)
        counts.clear()
        torch.distributed.barrier(group=env.group("world"))
        start = time.perf_counter()
        with moe_stats.routing_context(model, valid):
            losses = token_losses(model, tokens, torch.roll(tokens, -1, 1), positions, valid)
        losses.sum().backward()
        elapsed = dist_max(time.perf_counter() - start, env.device, group=env.group("world"))
        if step:
            times.append(elapsed)
    per_rank = all_gather_objects(dict(counts), group=env.group("world"))
    busiest = max(per_rank, key=lambda c: sum(c.values()))
    return {
        "ep": ep,
        "experts_per_rank": held.get("experts"),
        "step_s": statistics.median(times),
        "bytes": {k: busiest.get(k, 0) for k in KINDS},
        "bytes_total": sum(busiest.values()),
    }


def _worker(args) -> int:
    import torch.distributed as dist

    from backend.distributed.setup import init_distributed, shutdown_distributed

    counts: dict = {}  # this rank's bytes by kind, the current step's (each arm clears it)
    _count_collectives(counts)
    init_distributed(1)
    try:
        rows = [_arm(args, ep, counts) for ep in args.eps]
        if dist.get_rank() == 0:
            print("BENCH_JSON " + json.dumps(rows))
    finally:
        shutdown_distributed()
    return 0


def _table(rows: list[dict], args) -> str:
    base = rows[0]
    lines = [
        f"one MoE layer ({args.experts} experts, top {args.topk}, scale {args.scale}), {args.nproc} gloo ranks, "
        f"{args.tokens}..{int(args.tokens * (2 - 1 / args.nproc))} tokens a rank; the busiest rank's bytes per step",
        f"{'EP':>3} {'experts/rank':>12} {'weights gathered':>17} {'grads scattered':>16} {'tokens a2a':>11} "
        f"{'total':>10} {'vs EP ' + str(base['ep']):>8} {'step s':>8}",
    ]
    for r in rows:
        b = r["bytes"]
        mb = 1 / 2**20
        lines.append(
            f"{r['ep']:>3} {r['experts_per_rank']:>12} {b['gather'] * mb:>13.1f} MiB "
            f"{b['scatter'] * mb:>12.1f} MiB {b['a2a'] * mb:>7.1f} MiB "
            f"{r['bytes_total'] * mb:>6.1f} MiB {r['bytes_total'] / base['bytes_total']:>7.2f}x {r['step_s']:>8.3f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--eps", default="1,2,4", help="expert parallel sizes, comma-separated (each divides --nproc)")
    p.add_argument("--tokens", type=int, default=512, help="tokens of rank 0's microbatch (rank r: x (1 + r / world))")
    p.add_argument("--scale", type=float, default=0.125, help="width relative to GPT-OSS-20B (hidden 2880)")
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--json", action="store_true")
    argv = list(sys.argv[1:] if argv is None else argv)
    if "RANK" in os.environ:  # a rank torchrun started: the options come in the environment (see below)
        argv = json.loads(os.environ[ARGS_VARIABLE])
    args = p.parse_args(argv)
    args.eps = [int(x) for x in str(args.eps).split(",")]
    if "RANK" in os.environ:
        return _worker(args)
    from backend.distributed.launch import torchrun_command

    # Not on the command line: torchrun's parser takes --nproc (a prefix of its --nproc-per-node)
    # even after the script's name.
    cmd = torchrun_command(args.nproc, str(Path(__file__).resolve()))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **{ARGS_VARIABLE: json.dumps(argv)})
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        print(proc.stdout[-3000:], proc.stderr[-6000:], file=sys.stderr)
        return proc.returncode
    rows = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("BENCH_JSON "))[11:])
    print(_table(rows, args))
    if args.json:
        print(json.dumps({"nproc": args.nproc, "tokens": args.tokens, "scale": args.scale, "arms": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
