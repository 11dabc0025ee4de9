#!/usr/bin/env python3
"""The output layer with and without chunked logits, side by side in one run, on a model with
Qwen3's 151,936-token vocabulary (``model.logits_chunk_tokens``, backend/model/output.py).

    python tools/bench/bench_logits_chunk.py [--chunks 0,256,1024,4096] [--steps 6] [--limit-gib 4] [--vocab 151936]
        [--loss cross_entropy|policy] [--budget N|auto] [--layout packed|padded] [--profile] [--json] [overrides]

Per arm (one chunk size; 0 = whole logits): the memory probe's fit (bytes per token ``b``) and
the budget ``train.max_tokens_per_gpu: auto`` resolves at ``--limit-gib``; then the same windows
trained from the same weights, at one fixed budget (``--budget N``) or at each arm's own probed
budget (``--budget auto``: what a user of ``auto`` gets, larger microbatches for the chunked
arms), the arms' steps interleaved (A B A B ...) so a busy neighbour slows both alike: median step
time, the worst step's measured peak against its prediction, and each step's loss and gradient
norm (equal across arms to FP32 rounding). Prints a table and, with --json, one JSON object with
``arms`` and ``time_ratio`` / ``budget_ratio`` against the first arm. ``--profile`` prints, per
arm, one more step's operators by self CPU time (torch.profiler): where the time goes.

The model: the quickstart's 2 x 128 Qwen3-style decoder with ``model.vocab_size=151936`` (the
output layer is then most of the work, as it is for Qwen3-0.6B's memory), cross-entropy on
random byte rows of 96-512 tokens, full recomputation (``--recompute none`` to change).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

QWEN3_VOCAB = 151_936


def _rows(path: Path, count: int, seed: int, policy: bool = False) -> Path:
    import numpy as np

    rng = np.random.default_rng(seed)
    with path.open("w") as f:
        for _ in range(count):
            row = {"input_ids": rng.integers(0, 256, int(rng.integers(96, 513))).tolist()}
            if policy:
                row["advantages"] = float(rng.normal())
            f.write(json.dumps(row) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", default=[])
    p.add_argument("--chunks", default="0,1024,4096", help="comma-separated chunk sizes (0 = whole logits)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--budget", default="2048", help="train.max_tokens_per_gpu of the timed steps: a number, or auto")
    p.add_argument("--layout", default="packed", choices=("packed", "padded"))
    p.add_argument("--profile", action="store_true", help="print each arm's top operators for one more step")
    p.add_argument("--limit-gib", type=float, default=4.0, help="train.memory_limit_gib for the probe's budget")
    p.add_argument("--recompute", default="full", choices=("none", "selective", "full"))
    p.add_argument("--vocab", type=int, default=QWEN3_VOCAB, help="model.vocab_size (default Qwen3's)")
    p.add_argument("--loss", default="cross_entropy", choices=("cross_entropy", "policy"))
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    import logging

    logging.basicConfig(level=logging.WARNING)
    from backend.config import load_config, validate
    from backend.distributed.setup import init_distributed
    from backend.logging.metrics import read_metrics
    from backend.train.trainer import Trainer

    chunks = [int(c) for c in args.chunks.split(",")]
    env = init_distributed(1)
    with tempfile.TemporaryDirectory(prefix="bench_logits_chunk_") as tmp:
        rows = _rows(Path(tmp) / "rows.jsonl", 64, seed=0, policy=args.loss == "policy")
        base = [
            f"data.path={rows}",
            "data.tokenizer=byte",
            "data.max_seq_length=512",
            "data.valid_fraction=0",
            "data.prefetch=false",
            "train.eval_interval=0",
            "train.global_batch_size=8",
            "train.dynamic_batch_enable=true",
            f"train.dynamic_batch_layout={args.layout}",
            f"train.train_iters={args.steps + (1 if args.profile else 0)}",
            f"model.vocab_size={args.vocab}",
            *(
                ["loss.type=policy", "loss.old_logprobs=detach", "loss.entropy_coef=0.01"]
                if args.loss == "policy"
                else []
            ),
            f"model.recompute_granularity={args.recompute}",
            "checkpoint.interval=0",
            "checkpoint.resume=false",
            "logger.log_interval=1000",
            *args.overrides,
        ]
        arms, trainers = {}, {}
        for chunk in chunks:
            common = [*base, f"model.logits_chunk_tokens={chunk}", f"logger.run_dir={tmp}/probe{chunk}"]
            cfg = validate(
                load_config(
                    "configs/quickstart.yaml",
                    # a 64-row window (32k tokens at most), so the budget is not capped by the window
                    [
                        *common,
                        "train.max_tokens_per_gpu=auto",
                        f"train.memory_limit_gib={args.limit_gib}",
                        "train.global_batch_size=64",
                    ],
                )
            )
            probe = Trainer(cfg, env).memory
            arms[chunk] = {"bytes_per_token": probe.fit.b, "fixed_bytes": probe.fit.a, "auto_budget": probe.budget}
            run = [
                *base,
                f"model.logits_chunk_tokens={chunk}",
                f"logger.run_dir={tmp}/run{chunk}",
                f"train.max_tokens_per_gpu={args.budget}",
                f"train.memory_limit_gib={args.limit_gib}",
            ]
            trainers[chunk] = Trainer(validate(load_config("configs/quickstart.yaml", run)), env)
        for _ in range(args.steps):  # interleaved: A B A B ...
            for chunk in chunks:
                t = trainers[chunk]
                t.step += 1
                t.train_one_step()
        profiles = {}
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            for chunk in chunks:
                t = trainers[chunk]
                t.step += 1
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    t.train_one_step()
                profiles[chunk] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
        for chunk in chunks:
            trainers[chunk].metrics.close()
            steps, _ = read_metrics(Path(tmp) / f"run{chunk}" / "metrics.jsonl")
            steps = steps[: args.steps]  # the profiled step is not timed
            arms[chunk].update(
                budget=trainers[chunk].cfg.train.max_tokens_per_gpu,
                peak_over_prediction_max=max((r.get("peak_over_prediction_max_rank", 0.0) for r in steps), default=0.0),
                step_time_s=statistics.median(r["step_time_s"] for r in steps[1:] or steps),
                peak_memory_bytes=max(r["peak_memory_bytes"] for r in steps),
                loss=[r["loss"] for r in steps],
                grad_norm=[r["grad_norm"] for r in steps],
            )
    first = arms[chunks[0]]
    for arm in arms.values():
        arm["time_ratio"] = arm["step_time_s"] / first["step_time_s"]
        arm["budget_ratio"] = arm["auto_budget"] / first["auto_budget"]
        arm["loss_rel_diff_max"] = max(abs(a - b) / abs(b) for a, b in zip(arm["loss"], first["loss"]))
        arm["grad_norm_rel_diff_max"] = max(abs(a - b) / abs(b) for a, b in zip(arm["grad_norm"], first["grad_norm"]))
    print(
        f"vocabulary {args.vocab:,}, {args.loss}, {args.layout}, recompute {args.recompute}, {args.steps} steps at "
        f"train.max_tokens_per_gpu={args.budget}"
    )
    print(
        f"{'chunk':>6} {'KiB/token':>10} {'auto budget':>12} {'budget':>7} {'step s':>8} {'time x':>7} "
        f"{'peak MiB':>9} {'peak/pred':>9} {'loss rel':>9} {'gnorm rel':>9}"
    )
    for chunk, a in arms.items():
        over = f"{a['peak_over_prediction_max']:.3f}" if a["peak_over_prediction_max"] else "-"
        print(
            f"{chunk:>6} {a['bytes_per_token'] / 1024:>10.1f} {a['auto_budget']:>12,} {a['budget']:>7,} "
            f"{a['step_time_s']:>8.3f} {a['time_ratio']:>7.2f} {a['peak_memory_bytes'] / 2**20:>9.1f} {over:>9} "
            f"{a['loss_rel_diff_max']:>9.1e} {a['grad_norm_rel_diff_max']:>9.1e}"
        )
    for chunk, table in profiles.items():
        print(f"\nchunk {chunk}: one step's operators by self CPU time\n{table}")
    if args.json:
        print(
            json.dumps(
                {"vocab": QWEN3_VOCAB, "limit_gib": args.limit_gib, "arms": {str(k): v for k, v in arms.items()}}
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
