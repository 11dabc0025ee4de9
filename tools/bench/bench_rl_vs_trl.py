#!/usr/bin/env python3
"""Our GRPO loop against TRL's ``GRPOTrainer`` on the same model, prompts, reward and settings.

For each size and seed one random Hugging Face Qwen3 is built (``save_pretrained``, a byte-level
BPE tokenizer trained on the prompts) and both loops run on it, each in a fresh process on one
thread, FP32 on the CPU: a task of prompt rows and a reward function (default the GRPO demo's,
``configs/grpo_demo``: copy a three-letter word, reward = letters right; both arms call the same
function), 8 prompts x 8 samples a step, 8 new tokens, temperature 1, one optimizer step per
generation, the token-mean loss (TRL's ``loss_type="dapo"``), no KL, AdamW (0.9, 0.999, 1e-8,
no weight decay: TRL's defaults, ours set to them), learning rate 5e-3 constant, clipping at 1.

Reported per arm: the median seconds a step over the steps after the first (ours: ``loop_step_s``,
the step's whole wall time: generation, scoring, rows, training, weight sync; TRL: its trainer's
step callbacks, which enclose its generation), its generation and the rest (everything else:
scoring, advantages, rows, training, and ours the weight sync, also shown alone), the start-up
(process start to the first step, with teardown: the process's wall less its steps), the reward
curve and its gain (mean of the last 3 steps less the first 3).
Per size: ours / TRL of the medians pooled over the seeds, and the reward gains' means.

    python tools/bench/bench_rl_vs_trl.py [--sizes tiny,medium] [--seeds 0] [--steps 10] [--json]
        [--size NAME=LAYERS,HIDDEN,FFN,HEADS,KV_HEADS] [--prompts FILE.jsonl --reward FILE.py:fn]
        [--plot rewards.png]

TRL is an optional extra (``pip install -e '.[trl]'``).
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

from backend.bench.rl_task import PROMPTS, REPO, REWARD, SIZES, build_model, parse_size, run_trl, summary


def run_ours(model_dir: Path, run_dir: Path, args, seed: int) -> dict:
    start = time.time()
    cmd = [
        sys.executable,
        "-m",
        "backend.rl",
        str(REPO / "configs" / "grpo_demo.yaml"),
        f"model.hf_checkpoint={model_dir}",
        "model.attention_backend=sdpa",
        "train.precision=fp32",
        f"train.train_iters={args.steps}",
        f"train.seed={seed}",
        "optimizer.adam_beta2=0.999",  # TRL's (transformers') AdamW default; ours is 0.95
        f"rl.prompts={args.prompts}",
        f"rl.reward={args.reward}",
        f"rl.prompts_per_step={args.prompts_per_step}",
        f"rl.samples_per_prompt={args.samples}",
        f"rl.max_new_tokens={args.new_tokens}",
        "checkpoint.interval=0",
        f"logger.run_dir={run_dir}",
        "logger.log_interval=1000",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(f"our loop failed:\n{proc.stderr[-4000:]}")
    rows = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    parts = [
        {
            "step": r["loop_step_s"],
            "generate": r["generate_s"],
            "rest": r["loop_step_s"] - r["generate_s"],  # scoring, rows, training, sync, metrics
            "sync": r.get("weight_sync_s", 0.0),
        }
        for r in rows
    ]
    return summary(parts, [r["reward_mean"] for r in rows], proc_wall=time.time() - start)


def pooled(runs: list[dict]) -> dict:
    """One arm over its seeds: the median step over every seed's steps after the first, the mean
    reward gain, and each seed's own numbers."""
    steps = [s for r in runs for s in r["step_s"][1:]]
    return {
        "s_per_step": statistics.median(steps),
        "generate_s": statistics.median(r["generate_s"] for r in runs),
        "rest_s": statistics.median(r["rest_s"] for r in runs),
        "sync_s": statistics.median(r["sync_s"] for r in runs),
        "startup_s": statistics.median(r["startup_s"] for r in runs),
        "reward_gain": statistics.mean(r["reward_gain"] for r in runs if r["reward_gain"] is not None)
        if any(r["reward_gain"] is not None for r in runs)
        else None,
        "seeds": runs,
    }


def _table(results: dict) -> str:
    lines = [
        f"{'size':<8} {'arm':<5} {'s/step':>8} {'generate':>9} {'rest':>8} {'sync':>7} {'start-up':>9} "
        f"{'ours/TRL':>9} {'reward gain':>12}"
    ]
    for size, arms in results.items():
        for name in ("ours", "trl"):
            r = arms[name]
            ratio = arms["ratio"] if name == "ours" else 1.0
            gain = r["reward_gain"]
            lines.append(
                f"{size:<8} {name:<5} {r['s_per_step']:>8.3f} {r['generate_s']:>9.3f} {r['rest_s']:>8.3f} "
                f"{r['sync_s']:>7.3f} {r['startup_s']:>9.2f} {ratio:>8.2f}x "
                f"{gain if gain is not None else float('nan'):>12.3f}"
            )
    return "\n".join(lines)


def _curves(results: dict) -> str:
    """Each size's reward curves side by side: the mean over seeds, step by step."""
    lines = []
    for size, arms in results.items():
        curves = {
            n: [statistics.mean(v) for v in zip(*(r["rewards"] for r in arms[n]["seeds"]))] for n in ("ours", "trl")
        }
        lines.append(f"{size}: reward per step (mean over seeds), ours | TRL")
        for i, (a, b) in enumerate(zip(curves["ours"], curves["trl"]), 1):
            lines.append(f"  step {i:>3}  {a:6.3f} | {b:6.3f}")
    return "\n".join(lines)


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.5), squeeze=False)
    for ax, (size, arms) in zip(axes[0], results.items()):
        for name, label in (("ours", "ours"), ("trl", "TRL GRPOTrainer")):
            for k, run in enumerate(arms[name]["seeds"]):
                ax.plot(
                    range(1, len(run["rewards"]) + 1),
                    run["rewards"],
                    color="C0" if name == "ours" else "C1",
                    alpha=0.8,
                    label=label if k == 0 else None,
                )
        ax.set(title=f"{size}: ours {arms['ratio']:.2f}x TRL's step", xlabel="step", ylabel="mean reward")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="tiny,medium", help=f"comma-separated, of {', '.join(SIZES)} and --size names")
    p.add_argument("--size", action="append", default=[], help="NAME=LAYERS,HIDDEN,FFN,HEADS,KV_HEADS (repeatable)")
    p.add_argument("--seeds", default="0", help="comma-separated: each builds its own model and seeds both loops")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--prompts", type=Path, default=PROMPTS, help="prompt rows (JSONL, a 'prompt' field)")
    p.add_argument("--reward", default=REWARD, help="FILE.py:function or module:function, fn(prompt, response, row)")
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--out", default="runs/bench_rl_vs_trl")
    p.add_argument("--plot", type=Path, help="write the reward curves side by side as this PNG")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    try:
        import trl  # noqa: F401
    except ImportError:
        print("error: TRL is not installed (pip install -e '.[trl]')", file=sys.stderr)
        return 2
    shapes, sizes = dict(SIZES), [s for s in args.sizes.split(",") if s]
    for text in args.size:
        try:
            name, shape = parse_size(text)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        shapes[name] = shape
        sizes += [] if name in sizes else [name]
    unknown = [s for s in sizes if s not in shapes]
    if unknown:
        known = ", ".join(shapes)
        print(f"error: --sizes: unknown {', '.join(unknown)} (known: {known}; add one with --size)", file=sys.stderr)
        return 2
    args.prompts = args.prompts.resolve()
    out = Path(args.out).resolve()
    results = {}
    for size in sizes:
        runs = {"ours": [], "trl": []}
        for seed in (int(x) for x in args.seeds.split(",")):
            model_dir = build_model(out / size / f"model_{seed}", shapes[size], args.prompts, seed)
            runs["ours"].append(run_ours(model_dir, out / size / f"ours_{seed}_{time.time_ns()}", args, seed))
            runs["trl"].append(run_trl(model_dir, out / size / f"trl_{seed}", args, seed))
        arms = {name: pooled(r) for name, r in runs.items()}
        results[size] = {**arms, "ratio": arms["ours"]["s_per_step"] / arms["trl"]["s_per_step"], "shape": shapes[size]}
    print(_table(results))
    print(_curves(results))
    if args.plot:
        _plot(results, args.plot)
        print(f"reward curves: {args.plot}")
    if args.json:
        print(json.dumps({"steps": args.steps, "seeds": args.seeds, "sizes": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
