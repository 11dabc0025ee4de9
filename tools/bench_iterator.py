#!/usr/bin/env python3
"""Data-iterator overhead per optimizer step: plan, then collate and CP-cut this rank's microbatches.

    python tools/bench_iterator.py --dp 8 --cp 2 --global-batch-size 512 --json

Reports, per step, the planner's time alone and the whole iterator step on one rank (plan +
reading samples + right-padding + CP cut), in milliseconds and as a multiple of the plan time.
Run it on one core (taskset -c 0) for the one-core figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.batching import PlanArgs, make_planner  # noqa: E402
from backend.bench.length_sets import LENGTH_SETS, synthetic_lengths  # noqa: E402
from backend.data.iterator import DataIterator  # noqa: E402
from backend.data.jsonl import InMemoryDataset  # noqa: E402
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
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    lengths = synthetic_lengths(args.set, args.global_batch_size * 4, seed=1)
    dataset = InMemoryDataset([Sample(tokens=rng.integers(0, 256, n)) for n in lengths], source=args.set)
    planner = make_planner(
        "dynamic", PlanArgs(dp_size=args.dp, cp_size=args.cp, max_tokens_per_gpu=args.max_tokens_per_gpu)
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
    result = {
        "set": args.set,
        "dp": args.dp,
        "cp": args.cp,
        "global_batch_size": args.global_batch_size,
        "plan_ms_median": statistics.median(plan_ms),
        "iterator_step_ms_median": statistics.median(step_ms),
        "collate_and_cut_ms_median": statistics.median(s - q for s, q in zip(step_ms, plan_ms)),
    }
    result["iterator_over_plan"] = result["iterator_step_ms_median"] / result["plan_ms_median"]
    print(
        f"plan {result['plan_ms_median']:.2f} ms | iterator step (plan + collate + CP cut, one rank) "
        f"{result['iterator_step_ms_median']:.2f} ms = {result['iterator_over_plan']:.1f}x the plan"
    )
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
