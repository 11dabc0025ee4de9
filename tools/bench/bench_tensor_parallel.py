#!/usr/bin/env python3
"""Tensor parallel size 1, 2 and 4 side by side on one gloo world: what a rank holds and moves.

Each arm is its own ``torchrun`` of ``--nproc`` ranks (the world stays; dp = world / tp) building
the same dense model from the same seed (``build_model``: FSDP2 over dp, megatron-core's tensor-
parallel layers over tp, sequence parallelism on) and running forward + backward of one
``--tokens``-token row per data-parallel rank (the TP ranks of a group share theirs). Per rank:

- weights held: the bytes of every parameter as FSDP2 gathers it for compute (the TP slice);
- resident: the FSDP2 shards kept between steps (1 / world of the model at any tp);
- step peak over resident: the live tensor bytes above that during the step (activations, the
  gathered layer weights, the gradients; the CPU meter counts tensors, as the memory probe does);
- bytes handed to each collective, split by group: FSDP2's all-gathers of weights and
  reduce-scatters of gradients (over dp), and TP's all-gathers / reduce-scatters of sequence-
  parallel activations and all-reduces (over tp), the busiest rank's;
- the median step time of the slowest rank and the world's distinct tokens a second (each arm
  trains dp rows: on 2 shared CPU cores a sanity figure, not a GPU's).

    python tools/bench/bench_tensor_parallel.py [--nproc 4] [--tps 1,2,4] [--tokens 1024] [--hidden 512] [--json]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

COLLECTIVES = {
    "all_gather_single": "gather",
    "all_gather_into_tensor": "gather",
    "reduce_scatter_single": "scatter",
    "reduce_scatter_tensor": "scatter",
    "all_reduce": "all_reduce",
}
ARGS_VARIABLE = "BENCH_TENSOR_PARALLEL_ARGS"


def _count_collectives(counts: dict, groups: dict) -> None:
    """Wrap torch.distributed's collectives (before megatron-core binds its aliases of them) so each
    call adds its bytes to ``counts[(group purpose, kind)]``; ``groups`` maps a group to its purpose."""
    import torch
    import torch.distributed as dist

    for name, kind in COLLECTIVES.items():
        original = getattr(dist, name, None)
        if original is None:
            continue
        signature = inspect.signature(original)

        def counted(*args, _original=original, _kind=kind, _signature=signature, **kwargs):
            bound = _signature.bind_partial(*args, **kwargs).arguments
            tensors = [v for v in bound.values() if isinstance(v, torch.Tensor)]
            size = max(t.numel() * t.element_size() for t in tensors) if tensors else 0
            purpose = groups.get(id(bound.get("group")), "other")
            counts[(purpose, _kind)] = counts.get((purpose, _kind), 0) + size
            return _original(*args, **kwargs)

        setattr(dist, name, counted)


def _overrides(args, tp: int) -> list[str]:
    return [
        f"model.num_layers={args.layers}",
        f"model.hidden_size={args.hidden}",
        "model.num_attention_heads=8",
        "model.num_query_groups=4",
        f"model.ffn_hidden_size={3 * args.hidden}",
        "model.vocab_size=4096",
        "model.attention_backend=sdpa",
        "train.precision=fp32",
        "data.tokenizer=byte",
        f"data.max_seq_length={args.tokens}",
        f"parallel.tensor_parallel_size={tp}",
    ]


def _worker(args) -> int:
    counts: dict = {}
    groups: dict = {}
    _count_collectives(counts, groups)
    import torch

    from backend.config import load_config, validate
    from backend.distributed.collectives import all_gather_objects, dist_max
    from backend.distributed.setup import init_distributed, shutdown_distributed
    from backend.model.factory import build_model
    from backend.model.forward import token_losses
    from backend.train.memory_meter import MemoryMeter, resident_tensors

    tp = args.tp
    env = init_distributed(1, tp_size=tp)
    try:
        groups.update({id(env.group("tp")): "tp", id(env.group("loss")): "fsdp"})
        cfg = validate(load_config(None, _overrides(args, tp)), env.world_size)
        model = build_model(cfg, env, tokenizer_vocab=256).model
        held = sum(p.numel() * p.element_size() for p in model.parameters())  # FSDP2's global = the TP slice
        local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
        resident = sum(t.numel() * t.element_size() for t in local)
        g = torch.Generator().manual_seed(env.dp_rank)  # the TP ranks of a group share a row
        n = args.tokens
        tokens = torch.randint(0, 256, (1, n), generator=g)
        positions = torch.arange(n)[None]
        valid = torch.ones(1, n, dtype=torch.bool)
        meter = MemoryMeter(env.device, resident_tensors(model))
        start_bytes = meter_start(list(model.parameters()))
        times, peak = [], 0
        for step in range(args.steps + 1):  # the first is a warm-up
            model.zero_grad(set_to_none=True)
            counts.clear()
            torch.distributed.barrier(group=env.group("world"))
            start = time.perf_counter()
            with meter.step():
                token_losses(model, tokens, torch.roll(tokens, -1, 1), positions, valid).sum().backward()
            elapsed = dist_max(time.perf_counter() - start, env.device, group=env.group("world"))
            if step:
                times.append(elapsed)
                peak = max(peak, meter.peak_bytes)
        per_rank = all_gather_objects({"|".join(k): v for k, v in counts.items()}, group=env.group("world"))
        busiest = max(per_rank, key=lambda c: sum(c.values()))
        if env.is_main:
            row = {
                "tp": tp,
                "dp": env.dp_size,
                "weights_held_bytes": held,
                "resident_bytes": resident,
                "step_peak_over_resident_bytes": peak - start_bytes,
                "bytes": busiest,
                "bytes_total": sum(busiest.values()),
                "step_s": statistics.median(times),
                "tokens_per_s": env.dp_size * n / statistics.median(times),  # the world's distinct tokens
            }
            print("BENCH_JSON " + json.dumps(row))
    finally:
        shutdown_distributed(env)
    return 0


def meter_start(tensors) -> int:
    """Bytes of the tensors a step starts with (distinct storages, as the CPU meter counts them)."""
    seen, total = set(), 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def _table(rows: list[dict], args) -> str:
    mb = 1 / 2**20
    kinds = sorted({k for r in rows for k in r["bytes"]})
    lines = [
        f"{args.layers} layers x {args.hidden} (8 heads, 4 KV heads, FFN {3 * args.hidden}, vocabulary 4096), "
        f"{args.nproc} gloo ranks, a {args.tokens}-token row per data-parallel rank, FP32; the busiest rank's MiB",
        " ".join(
            [f"{'TP':>3} {'dp':>3} {'weights held':>12} {'resident':>9} {'peak-resident':>13}"]
            + [f"{k:>18}" for k in kinds]
            + [f"{'total moved':>11} {'step s':>7} {'tokens/s':>9}"]
        ),
    ]
    for r in rows:
        cells = [
            f"{r['tp']:>3} {r['dp']:>3} {r['weights_held_bytes'] * mb:>12.2f} {r['resident_bytes'] * mb:>9.2f} "
            f"{r['step_peak_over_resident_bytes'] * mb:>13.2f}"
        ]
        cells += [f"{r['bytes'].get(k, 0) * mb:>18.2f}" for k in kinds]
        cells += [f"{r['bytes_total'] * mb:>11.2f} {r['step_s']:>7.3f} {r['tokens_per_s']:>9.0f}"]
        lines.append(" ".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--tps", default="1,2,4", help="tensor parallel sizes, comma-separated (each divides --nproc)")
    p.add_argument("--tokens", type=int, default=1024, help="tokens of each data-parallel rank's row")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json", action="store_true")
    argv = list(sys.argv[1:] if argv is None else argv)
    if "RANK" in os.environ:  # a rank torchrun started: the options come in the environment
        args = p.parse_args(json.loads(os.environ[ARGS_VARIABLE]))
        args.tp = int(os.environ["BENCH_TP"])
        return _worker(args)
    args = p.parse_args(argv)
    from backend.distributed.launch import torchrun_command

    rows = []
    for tp in (int(x) for x in args.tps.split(",")):
        cmd = torchrun_command(args.nproc, str(Path(__file__).resolve()))
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", BENCH_TP=str(tp))
        env[ARGS_VARIABLE] = json.dumps(argv)
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode:
            print(proc.stdout[-3000:], proc.stderr[-6000:], file=sys.stderr)
            return proc.returncode
        rows.append(json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("BENCH_JSON "))[11:]))
    print(_table(rows, args))
    if args.json:
        print(json.dumps({"nproc": args.nproc, "tokens": args.tokens, "hidden": args.hidden, "arms": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
