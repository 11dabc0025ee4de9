#!/usr/bin/env python3
"""The GRPO loop synchronous (rl.max_staleness 0) against asynchronous (k = 1, 2), side by side.

Each arm is the real loop (``PolicyWorker``, its generator, ``GRPOLoop`` / ``AsyncGRPOLoop``) on
the GRPO demo task with longer responses (``--new-tokens``: no stop id, each response runs to
it), from the same seed; the arms' steps are interleaved (A B C A B C ...) in one process, so a
busy neighbour slows every arm alike. The asynchronous arms' generator processes take 1 thread.
Per arm: the median wall time of a loop step (generate, score, train, sync, as the caller sees
it), its ratio to the synchronous arm's, where each side waited (the trainer for rollouts, the
generator for requests), the weight sync, and the reward gain (mean of the last 5 steps' rewards
minus the first 5's). Prints a table and, with --json, one JSON object.

    python tools/bench/bench_async_rl.py [--ks 0,1,2] [--steps 30] [--new-tokens 48] [--json] [overrides ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _arm(k: int, run_dir: Path, overrides: list[str], env):
    from backend.rl.async_loop import AsyncGRPOLoop
    from backend.rl.cli import build_generator
    from backend.rl.loop import GRPOLoop
    from backend.rl.worker import PolicyWorker

    keys = [
        *overrides,
        f"rl.max_staleness={k}",
        f"logger.run_dir={run_dir}",
        "checkpoint.interval=0",
        "logger.log_interval=1000000",
    ]
    worker = PolicyWorker.from_config(str(REPO / "configs" / "grpo_demo.yaml"), keys, env=env)
    generator = build_generator(worker)
    loop = (AsyncGRPOLoop if k else GRPOLoop)(worker, generator)
    return worker, generator, loop


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", default=[], help="dotted.key=value overrides for every arm")
    p.add_argument("--ks", default="0,1,2", help="comma-separated rl.max_staleness values (0 = synchronous)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--new-tokens", type=int, default=48, help="rl.max_new_tokens (responses run to it)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    from backend.config import load_config
    from backend.distributed.setup import init_from_config, shutdown_distributed

    ks = [int(k) for k in args.ks.split(",")]
    overrides = [
        f"train.train_iters={args.steps}",
        f"rl.max_new_tokens={args.new_tokens}",
        "rl.stop_token_ids=[]",
        f"data.max_seq_length={64 + args.new_tokens}",
        *args.overrides,
    ]
    env = init_from_config(load_config(REPO / "configs" / "grpo_demo.yaml", overrides))
    arms, times, rows = {}, {k: [] for k in ks}, {k: [] for k in ks}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for k in ks:
                arms[k] = _arm(k, Path(tmp) / f"k{k}", overrides, env)
            for _ in range(args.steps):
                for k in ks:
                    start = time.perf_counter()
                    rows[k].append(arms[k][2].step())
                    times[k].append(time.perf_counter() - start)
    finally:
        for worker, generator, _ in arms.values():
            if hasattr(generator, "close"):
                generator.close()
            worker.close()
        shutdown_distributed(env)

    def mean(k, key):
        values = [r[key] for r in rows[k] if key in r]
        return statistics.mean(values) if values else None

    base = statistics.median(times[ks[0]])
    out = {"steps": args.steps, "new_tokens": args.new_tokens, "arms": {}}
    for k in ks:
        rewards = [r["reward_mean"] for r in rows[k]]
        out["arms"][str(k)] = {
            "step_wall_s": statistics.median(times[k]),
            "ratio": statistics.median(times[k]) / base,
            "generate_s": mean(k, "generate_s"),
            "train_s": mean(k, "step_time_s"),
            "trainer_idle_s": mean(k, "trainer_idle_s"),
            "generator_idle_s": mean(k, "generator_idle_s"),
            "weight_sync_s": mean(k, "weight_sync_s"),
            "weight_sync_bytes": mean(k, "weight_sync_bytes"),
            "staleness_max": max((r.get("staleness_max", 0) for r in rows[k]), default=0),
            "reward_gain": statistics.mean(rewards[-5:]) - statistics.mean(rewards[:5]),
            "reward_last5": statistics.mean(rewards[-5:]),
        }
    print(f"GRPO demo task, {args.steps} steps, {args.new_tokens} new tokens a response, arms interleaved")
    print(" k  step s  ratio  generate s  train s  trainer idle  generator idle  sync s  lag  reward gain")
    for k, a in out["arms"].items():
        print(
            f"{k:>2}  {a['step_wall_s']:6.3f}  {a['ratio']:5.2f}  {a['generate_s']:10.3f}  {a['train_s']:7.3f}  "
            f"{a['trainer_idle_s'] or 0:12.3f}  {a['generator_idle_s'] or 0:14.3f}  {a['weight_sync_s'] or 0:6.3f}  "
            f"{a['staleness_max']:3d}  {a['reward_gain']:11.3f}"
        )
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
