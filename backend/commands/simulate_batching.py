#!/usr/bin/env python3
"""Plan synthetic or file-given length sets and compare the planner with two baselines.

Schedulers, on the same windows: ``dynamic`` (this backend's planner, padded rows),
``dynamic_packed`` (the same planner, packed rows), ``sort_and_stride`` (the widely used greedy)
and ``fixed_mbs1`` (micro-batch size 1). Every plan's invariants are checked (coverage, the
budget, the same count on every rank, determinism): ``invariants_ok``. Prints a table, or with ``--json``
one JSON object per (length set, scheduler) line.

    python tools/simulate_batching.py --dp 8 --cp 2 --max-tokens-per-gpu 16384 --json
    python tools/simulate_batching.py --lengths-file lengths.txt --global-batch-size 256
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from backend.batching import (
    DEFAULT_ATTENTION_WEIGHT,
    DEFAULT_MICROBATCH_OVERHEAD,
    PlanArgs,
    choose_bucket_edges,
    pad_multiple,
    plan,
)  # noqa: E402
from backend.bench.length_sets import LENGTH_SETS, read_lengths_file, synthetic_lengths  # noqa: E402

SCHEDULERS = ("dynamic", "dynamic_packed", "sort_and_stride", "fixed_mbs1")


def plan_with(scheduler: str, lengths: list[int], args: argparse.Namespace, edges=None):
    """``scheduler`` is dynamic, dynamic_packed, sort_and_stride or fixed_mbs1 (the fixed planner at size 1)."""
    plan_args = PlanArgs(
        dp_size=args.dp,
        cp_size=args.cp,
        sp_size=args.sp,
        max_tokens_per_gpu=args.max_tokens_per_gpu,
        micro_batch_size=1,
        pad_to_multiple=args.pad_to_multiple,
        overhead=args.overhead,
        bucket_edges=edges if scheduler.startswith("dynamic") else None,
        layout="packed" if scheduler == "dynamic_packed" else "padded",
        attention_weight=args.attention_weight,
    )
    kind = {"fixed_mbs1": "fixed", "dynamic_packed": "dynamic"}.get(scheduler, scheduler)
    return plan(kind, lengths, plan_args)


def invariants_ok(p, lengths: list[int], args: argparse.Namespace) -> bool:
    """Coverage, the budget for every multi-sequence microbatch, the same count on every rank,
    empty microbatches empty, singletons over the budget counted, and the plan deterministic."""
    counts = {len(rank) for rank in p.ranks}
    empties_ok = all(mb.cost == 0 and mb.tokens == 0 for rank in p.ranks for mb in rank if not mb.indices)
    singles = sum(
        1
        for rank in p.ranks
        for mb in rank
        if len(mb.indices) == 1 and p.max_tokens_per_gpu and mb.cost > p.max_tokens_per_gpu
    )
    return (
        p.covers(len(lengths))
        and len(counts) == 1
        and p.over_budget_microbatches() == 0
        and empties_ok
        and (p.max_tokens_per_gpu is None or singles == p.oversize_singletons)
        and p.padding_efficiency <= 1.0
    )


def simulate(set_name: str, windows: list[list[int]], args: argparse.Namespace, edges=None) -> list[dict]:
    rows = []
    for scheduler in SCHEDULERS:
        tokens = padded = microbatches = step_time = over = oversize = 0
        coverage_ok, all_ok, plan_ms, shapes, padded_lengths = True, True, [], [], set()
        for lengths in windows:
            start = time.perf_counter()
            plan = plan_with(scheduler, lengths, args, edges)
            plan_ms.append((time.perf_counter() - start) * 1e3)
            tokens += plan.tokens
            padded += plan.padded_tokens
            microbatches += plan.num_microbatches
            step_time += plan.modelled_step_time
            over += plan.over_budget_microbatches()
            oversize += plan.oversize_singletons
            coverage_ok &= plan.covers(len(lengths))
            all_ok &= invariants_ok(plan, lengths, args)
            all_ok &= plan_with(scheduler, lengths, args, edges).fingerprint == plan.fingerprint
            shapes.append(plan.distinct_shapes)
            padded_lengths |= {mb.padded_len for rank in plan.ranks for mb in rank if mb.indices}
        steps = len(windows)
        rows.append(
            {
                "set": set_name,
                "scheduler": scheduler,
                "dp": args.dp,
                "cp": args.cp,
                "sp": args.sp,
                "max_tokens_per_gpu": args.max_tokens_per_gpu,
                "pad_to_multiple": args.pad_to_multiple,
                "steps": steps,
                "sequences_per_step": statistics.mean(len(w) for w in windows),
                "padding_efficiency": tokens / padded,
                "num_microbatches": microbatches / steps,
                "modelled_step_time": step_time / steps,
                "over_budget_microbatches": over,
                "oversize_singletons": oversize,
                "coverage_ok": coverage_ok,
                "invariants_ok": all_ok,
                "layout": "packed" if scheduler == "dynamic_packed" else "padded",
                "attention_weight": args.attention_weight,
                "distinct_shapes": statistics.mean(shapes),
                "plan_ms": statistics.median(plan_ms),
                "max_shapes": args.max_shapes if scheduler.startswith("dynamic") else 0,
                "distinct_padded_lengths": len(padded_lengths),
            }
        )
    return rows


def print_table(rows: list[dict]) -> None:
    head = f"{'set':14} {'scheduler':16} {'pad_eff':>8} {'mbs/step':>9} {'step_time':>11} {'vs_dyn':>7} {'over':>5} {'oversz':>6} {'cover':>5} {'inv':>5} {'plan_ms':>8} {'lengths':>7}"
    print(head)
    print("-" * len(head))
    dyn = {r["set"]: r["modelled_step_time"] for r in rows if r["scheduler"] == "dynamic"}
    for r in rows:
        print(
            f"{r['set']:14} {r['scheduler']:16} {r['padding_efficiency']:8.3f} {r['num_microbatches']:9.1f} "
            f"{r['modelled_step_time']:11.0f} {r['modelled_step_time'] / dyn[r['set']]:7.2f} "
            f"{r['over_budget_microbatches']:5d} {r['oversize_singletons']:6d} {str(r['coverage_ok']):>5} {str(r['invariants_ok']):>5} {r['plan_ms']:8.2f} {r['distinct_padded_lengths']:7d}"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--set", action="append", choices=LENGTH_SETS, help="length set (repeatable; default: all)")
    p.add_argument("--lengths-file", help="file of lengths, one integer a line, cut into windows")
    p.add_argument("--dp", type=int, default=8)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument(
        "--sp",
        type=int,
        default=1,
        help="the sequence-parallel split: parallel.tensor_parallel_size with sequence parallelism (rows aligned "
        "to 2 x cp x sp, priced over cp x sp GPUs), else 1",
    )
    p.add_argument("--max-tokens-per-gpu", type=int, default=16384)
    p.add_argument("--pad-to-multiple", type=int, default=1)
    p.add_argument("--global-batch-size", type=int, default=512, help="sequences per optimizer step")
    p.add_argument("--steps", type=int, default=4, help="windows per set")
    p.add_argument("--cap", type=int, default=8192, help="longest synthetic length")
    p.add_argument("--overhead", type=int, default=DEFAULT_MICROBATCH_OVERHEAD, help="per-microbatch cost, tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--attention-weight",
        type=float,
        default=DEFAULT_ATTENTION_WEIGHT,
        help="planner's attention term, token-equivalents per token x length",
    )
    p.add_argument("--max-shapes", type=int, default=0, help="cap distinct padded lengths (0: exact lengths)")
    p.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    args = p.parse_args(argv)
    for name in ("dp", "cp", "max_tokens_per_gpu", "pad_to_multiple", "global_batch_size", "steps", "cap"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")

    sets: dict[str, list[list[int]]] = {}
    gbs = args.global_batch_size
    if args.lengths_file:
        lengths = read_lengths_file(args.lengths_file)
        # Every length is planned: the last window may be shorter than the global batch size.
        windows = [lengths[i : i + gbs] for i in range(0, len(lengths), gbs)][: args.steps]
        sets[Path(args.lengths_file).name] = windows
    for name in args.set or ([] if args.lengths_file else LENGTH_SETS):
        sets[name] = [
            synthetic_lengths(name, gbs, seed=args.seed * 1000 + step, cap=args.cap) for step in range(args.steps)
        ]
    try:
        rows = []
        for name, windows in sets.items():
            edges = None
            if args.max_shapes:  # edges from the set's distribution: a separate sample, not the windows
                sample = (
                    [n for w in windows for n in w]
                    if name not in LENGTH_SETS
                    else synthetic_lengths(name, 20000, seed=10**6 + args.seed, cap=args.cap)
                )
                edges = choose_bucket_edges(
                    sample, args.max_shapes, pad_multiple(args.pad_to_multiple, args.cp, args.sp)
                )
            rows += simulate(name, windows, args, edges)
    except ValueError as e:
        p.error(str(e))
    if args.json:
        for row in rows:
            print(json.dumps(row))
    else:
        print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
