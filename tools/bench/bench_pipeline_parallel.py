#!/usr/bin/env python3
"""Pipeline parallel size 1, 2 and 4 side by side on gloo: what a stage holds, how long a step
takes, the bubble measured against the one 1F1B predicts, and the bytes between stages.

Each arm is its own ``torchrun`` of ``pp`` ranks (data parallel 1: every rank is one stage of one
pipeline) training the same dense model from the same seed and the same windows (``python -m
backend.train``, dynamic batching, ``--layers`` decoder layers). From the arms' ``metrics.jsonl``:

- parameter bytes per rank: the largest stage's parameters in FP32 (the whole model at PP 1),
  from the stage split (``ParallelDims.stage_layers``) on the meta device;
- step time: the median over the steps after the first;
- ``pipeline_bubble`` (each stage's time waiting for its neighbours over its step, mean over the
  stages) against ``pipeline_bubble_modelled`` (1F1B simulated on the plan's microbatch costs);
- point-to-point bytes a step: each microbatch's activation forward and its gradient backward
  across each of the pp - 1 stage boundaries, [tokens, hidden] in FP32.

Each PP > 1 runs twice: ``parallel.pipeline_order=bubble`` (the smallest microbatch first, the
second smallest last, when 1F1B's model says that is shorter) and ``plan`` (the plan's own order),
the same windows, so the two orders' measured and modelled bubbles sit side by side. On 2 shared
CPU cores the step times are a sanity figure, not a GPU's; the bubble fractions are what to read.

    python tools/bench/bench_pipeline_parallel.py [--pps 1,2,4] [--layers 4] [--hidden 256] [--steps 6] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _overrides(args, run_dir: Path, pp: int, order: str = "bubble") -> list[str]:
    return [
        f"model.num_layers={args.layers}",
        f"model.hidden_size={args.hidden}",
        "model.num_attention_heads=4",
        "model.num_query_groups=2",
        "model.attention_backend=sdpa",
        "train.precision=fp32",
        "data.max_seq_length=512",
        "data.valid_fraction=0",
        "train.eval_interval=0",
        "train.dynamic_batch_enable=true",
        f"train.max_tokens_per_gpu={args.budget}",
        f"train.global_batch_size={args.batch}",
        f"train.train_iters={args.steps}",
        "checkpoint.interval=0",
        "logger.log_interval=1000000",
        f"logger.run_dir={run_dir}",
        f"parallel.pipeline_parallel_size={pp}",
        f"parallel.pipeline_order={order}",
    ]


def stage_bytes(args, pp: int) -> int:
    """FP32 bytes of the largest stage's parameters, from the whole model on the meta device (no
    memory) and the stage split: a stage holds its layers, the first the embedding, the last the
    final norm and the output layer (a tied one as its own copy)."""
    from backend.config import load_config
    from backend.distributed.parallel_dims import ParallelDims
    from backend.distributed.setup import init_distributed, shutdown_distributed
    from backend.model.factory import meta_model
    from backend.model.pipeline_stage import StageNames

    cfg = load_config(REPO / "configs" / "quickstart.yaml", _overrides(args, Path("unused"), 1))
    env = init_distributed(1)  # megatron-core's layers read their groups even on the meta device
    try:
        whole = dict(meta_model(cfg, tokenizer_vocab=256).named_parameters())
    finally:
        shutdown_distributed(env)
    dims = ParallelDims(world_size=pp, pp=pp)
    largest = 0
    for stage in range(pp):
        first, count = dims.stage_range(stage, args.layers)
        names = StageNames(stage, pp, first, count, tied=cfg.model.tie_embeddings)
        held = [n for n in whole if names.local(n) is not None]
        largest = max(largest, sum(whole[n].numel() * 4 for n in held))
    return largest


def run_arm(args, pp: int, order: str, work: Path) -> dict:
    from backend.distributed.launch import torchrun_command

    run_dir = work / f"pp{pp}_{order}"
    cmd = torchrun_command(
        pp, "-m", "backend.train", str(REPO / "configs" / "quickstart.yaml"), *_overrides(args, run_dir, pp, order)
    )
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"arm pp={pp} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("event") is None][1:] or rows  # the first step warms up
    p2p = [2 * (pp - 1) * r["padded_tokens"] * args.hidden * 4 for r in rows]
    return {
        "pp": pp,
        "order": order,
        "step_s": statistics.median(r["step_time_s"] for r in rows),
        "loss_last": rows[-1]["loss"],
        "num_microbatches": statistics.median(r["num_microbatches"] for r in rows),
        "bubble_measured": statistics.mean(r.get("pipeline_bubble", 0.0) for r in rows),
        "bubble_measured_max": max(r.get("pipeline_bubble_max", 0.0) for r in rows),
        "bubble_modelled": statistics.mean(r.get("pipeline_bubble_modelled", 0.0) for r in rows),
        "bubble_modelled_plan_order": statistics.mean(r.get("pipeline_bubble_modelled_plan_order", 0.0) for r in rows),
        "p2p_bytes_per_step": statistics.median(p2p),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pps", default="1,2,4", help="comma-separated pipeline parallel sizes")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (each pp must divide into them)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=32, help="train.global_batch_size")
    p.add_argument("--budget", type=int, default=2048, help="train.max_tokens_per_gpu")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_pp_") as tmp:
        arms = [
            (int(pp), order)
            for pp in args.pps.split(",")
            for order in (("bubble", "plan") if int(pp) > 1 else ("plan",))
        ]
        rows = [run_arm(args, pp, order, Path(tmp)) for pp, order in arms]
    for row in rows:  # after the arms: this process then joins a world of its own
        row["param_bytes_per_rank"] = stage_bytes(args, row["pp"])
    base = rows[0]
    print(
        f"{'pp':>3} {'order':>7} {'params/rank MiB':>16} {'step s':>8} {'vs pp1':>7} {'mbs':>5} {'bubble':>7} {'max':>6} "
        f"{'modelled':>9} {'p2p MiB/step':>13} {'final loss':>11}"
    )
    for r in rows:
        print(
            f"{r['pp']:>3} {r['order']:>7} {r['param_bytes_per_rank'] / 2**20:>16.2f} {r['step_s']:>8.3f} "
            f"{r['step_s'] / base['step_s']:>7.2f} {r['num_microbatches']:>5.0f} {r['bubble_measured']:>7.3f} "
            f"{r['bubble_measured_max']:>6.3f} {r['bubble_modelled']:>9.3f} {r['p2p_bytes_per_step'] / 2**20:>13.2f} "
            f"{r['loss_last']:>11.6f}"
        )
    if args.json:
        print(json.dumps({"arms": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
