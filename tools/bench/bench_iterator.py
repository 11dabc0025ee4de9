#!/usr/bin/env python3
"""Data-iterator overhead per optimizer step: plan, then collate and CP-cut this rank's microbatches.

    python tools/bench/bench_iterator.py --dp 8 --cp 2 --global-batch-size 512 --json
    python tools/bench/bench_iterator.py --layout packed --global-batch-size 4096 --json

Reports, per step, the planner's time alone and the whole iterator step on one rank (plan +
reading samples + right-padding + CP cut), in milliseconds and as a multiple of the plan time.
Then ``data_wait_s``: how long a training step waits for its window, preparing it synchronously
at the start of the step and in the background (``data.prefetch``) while the previous step
computes; the step's compute is stood in for by a sleep of --compute-ms (default: 1.5x the
iterator step; a sleep, like GPU kernels, releases the interpreter to the background thread).
Run it on one core (taskset -c 0) for the one-core figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from backend.batching import PlanArgs, make_planner  # noqa: E402
from backend.bench.length_sets import LENGTH_SETS, synthetic_lengths  # noqa: E402
from backend.data.iterator import DataIterator  # noqa: E402
from backend.data.jsonl import InMemoryDataset  # noqa: E402
from backend.data.prefetch import PrefetchingIterator, SyncIterator  # noqa: E402
from backend.data.sample import Sample  # noqa: E402
from backend.data.sampler import WindowSampler  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--set", default="rl_longtail", choices=LENGTH_SETS)
    p.add_argument("--dp", type=int, default=8)
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--max-tokens-per-gpu", type=int, default=16384)
    p.add_argument("--global-batch-size", type=int, default=512)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--layout", default="padded", choices=("padded", "packed"))
    p.add_argument("--compute-ms", type=float, default=0.0, help="stand-in step compute (0: 1.5x the iterator step)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    lengths = synthetic_lengths(args.set, args.global_batch_size * 4, seed=1)
    dataset = InMemoryDataset([Sample(tokens=rng.integers(0, 256, n)) for n in lengths], source=args.set)
    planner = make_planner(
        "dynamic",
        PlanArgs(dp_size=args.dp, cp_size=args.cp, max_tokens_per_gpu=args.max_tokens_per_gpu, layout=args.layout),
    )
    plan_ms, step_ms = [], []

    def timed_planner(lengths):  # the iterator's own planning call, timed inside the step
        start = time.perf_counter()
        plan = planner(lengths)
        plan_ms.append((time.perf_counter() - start) * 1e3)
        return plan

    for rank in range(min(args.dp, 2)):  # rank 0 holds the costliest microbatches
        sampler = WindowSampler(len(dataset), args.global_batch_size, seed=0)
        it = DataIterator(dataset, sampler, timed_planner, dp_rank=rank, cp_rank=0, cp_size=args.cp)
        for _ in range(args.steps):
            start = time.perf_counter()
            next(it)
            step_ms.append((time.perf_counter() - start) * 1e3)
    compute_s = (args.compute_ms or 1.5 * statistics.median(step_ms)) / 1e3
    waits = {}
    for mode, wrap in (("sync", SyncIterator), ("prefetch", PrefetchingIterator)):
        sampler = WindowSampler(len(dataset), args.global_batch_size, seed=0)
        it = wrap(DataIterator(dataset, sampler, planner, dp_rank=0, cp_rank=0, cp_size=args.cp))
        waits[mode] = []
        for _ in range(args.steps):
            next(it)
            waits[mode].append(it.last_wait_s * 1e3)
            time.sleep(compute_s)  # the training step
    result = {
        "set": args.set,
        "layout": args.layout,
        "dp": args.dp,
        "cp": args.cp,
        "global_batch_size": args.global_batch_size,
        "plan_ms_median": statistics.median(plan_ms),
        "iterator_step_ms_median": statistics.median(step_ms),
        "collate_and_cut_ms_median": statistics.median(s - q for s, q in zip(step_ms, plan_ms)),
    }
    result["iterator_over_plan"] = result["iterator_step_ms_median"] / result["plan_ms_median"]
    result["compute_ms"] = compute_s * 1e3
    # the first step always waits (nothing was prepared before it): the median is over the rest
    result["data_wait_ms_sync"] = statistics.median(waits["sync"][1:])
    result["data_wait_ms_prefetch"] = statistics.median(waits["prefetch"][1:])
    print(
        f"{args.layout}, {args.global_batch_size} sequences/window: plan {result['plan_ms_median']:.2f} ms | "
        f"iterator step (plan + collate + CP cut, one rank) {result['iterator_step_ms_median']:.2f} ms = "
        f"{result['iterator_over_plan']:.1f}x the plan"
    )
    print(
        f"data_wait_s per step with {result['compute_ms']:.0f} ms of compute: synchronous "
        f"{result['data_wait_ms_sync']:.2f} ms, prefetched {result['data_wait_ms_prefetch']:.2f} ms"
    )
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
