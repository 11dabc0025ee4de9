#!/usr/bin/env python3
"""Where one step of our GRPO loop goes: by phase, by operator, and what each fast path saves.

The model, task and settings of ``bench_rl_vs_trl.py`` (a random Qwen3 of ``--size``, the GRPO
demo's task, 8 prompts x 8 samples, 8 new tokens, one thread, FP32 on the CPU). Each arm runs in
its own process (``backend.rl`` in process, ``--steps`` steps after one warm-up step) and reports
the median over its steps of each phase, from the step rows: generation, reward scoring, rows to
plan (parsing, planning, plan checks), forward + backward + update, the weight sync into the
generator, and the rest of the loop (rows, advantages, metrics). Arms:

- ``now``: as shipped;
- ``+meter``: ``train.memory_meter=always`` (the CPU meter's dispatch mode on every operator);
- ``+fsdp``: FSDP2 wrapping the one-rank model (``uses_fsdp`` forced true);
- ``+per_sequence``: the dense-mask and one-call-per-sequence SDPA paths (``CAUSAL_FAST_PATHS``);
- ``+n_prefills``: each prompt prefilled once per sample (``share_prompt_prefill``);
- ``+multinomial``: ``torch.multinomial``'s draws (``HFGenerator.sampler``);
- ``before``: all five at once (the step before these changes, but for the reward thread).

``--ops`` adds, from one more run of the ``now`` arm under ``torch.profiler`` (not timed), its
operators grouped: matmuls, attention,
normalisation and activations, optimizer, sampling, copies, collectives, the autograd engine's
own time, views and allocations, other element-wise operators, the rest.

``--trl`` adds TRL's ``GRPOTrainer`` on the same model and task (its step, generation and the
rest; with ``--ops`` its operators beside ours).

    python tools/bench/profile_rl_step.py [--size tiny] [--steps 10] [--ops] [--trl] [--json]
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

from backend.bench.rl_task import OP_GROUPS, PROMPTS, REPO, REWARD, SIZES, build_model, op_groups, run_trl

ARMS = {
    "now": (),
    "+meter": ("meter",),
    "+fsdp": ("fsdp",),
    "+per_sequence": ("per_sequence",),
    "+n_prefills": ("n_prefills",),
    "+multinomial": ("multinomial",),
    "before": ("meter", "fsdp", "per_sequence", "n_prefills", "multinomial"),
}
PHASES = ("generate", "reward", "rows_to_plan", "train", "weight_sync", "loop_rest")


def _arm_process(model_dir: str, run_dir: str, steps: int, changes: list[str], ops: bool) -> dict:
    """One arm in this process: build the worker and the generator as ``backend.rl`` does, one
    warm-up step, then ``steps`` timed steps; the step rows (and with ``ops`` the operators)."""
    import torch

    torch.set_num_threads(1)
    if "fsdp" in changes:
        import backend.distributed.fsdp as fsdp

        fsdp.uses_fsdp = lambda env, *, bf16: True
    if "per_sequence" in changes:
        import backend.model.attention.sdpa as sdpa

        sdpa.CAUSAL_FAST_PATHS = False
    from backend.generators.hf import HFGenerator

    if "n_prefills" in changes:
        HFGenerator.share_prompt_prefill = False
    if "multinomial" in changes:
        HFGenerator.sampler = "multinomial"
    from backend.config import load_config, validate
    from backend.distributed.setup import init_from_config, shutdown_distributed
    from backend.rl.cli import build_generator
    from backend.rl.loop import GRPOLoop
    from backend.rl.worker import PolicyWorker

    config = str(REPO / "configs" / "grpo_demo.yaml")
    overrides = [
        f"model.hf_checkpoint={model_dir}",
        "model.attention_backend=sdpa",
        "train.precision=fp32",
        f"train.train_iters={steps + 1}",
        "rl.max_new_tokens=8",
        "checkpoint.interval=0",
        f"logger.run_dir={run_dir}",
        "logger.log_interval=1000000",
        f"train.memory_meter={'always' if 'meter' in changes else 'auto'}",
    ]
    env = init_from_config(validate(load_config(config, overrides), world_size=1, from_memory=True))
    worker = PolicyWorker.from_config(config, overrides, env=env)
    try:
        loop = GRPOLoop(worker, build_generator(worker))
        loop.step()
        profiler = None
        if ops:
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            profiler.__enter__()
        rows = [loop.step() for _ in range(steps)]
        out = {"rows": rows}
        if profiler is not None:
            profiler.__exit__(None, None, None)
            out["ops"] = op_groups(profiler.key_averages(), steps)
        return out
    finally:
        worker.close()
        shutdown_distributed(env)


def phases(row: dict) -> dict:
    """A step row's wall time cut into PHASES (seconds)."""
    parts = {
        "generate": row["generate_s"],
        "reward": row.get("reward_s", 0.0),
        "rows_to_plan": row["data_time_s"],
        "train": row["step_time_s"] + row.get("logprobs_s", 0.0),
        "weight_sync": row.get("weight_sync_s", 0.0),
    }
    parts["loop_rest"] = row["loop_step_s"] - sum(parts.values())
    return parts


def run_arm(model_dir: Path, out: Path, name: str, steps: int, ops: bool) -> dict:
    """``name``'s arm in a fresh process on one thread; medians of its phases."""
    run_dir = out / f"{name.strip('+')}_{time.time_ns()}"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=str(REPO))
    cmd = [sys.executable, __file__, "--child", str(model_dir), str(run_dir), str(steps), ",".join(ARMS[name])]
    proc = subprocess.run([*cmd, *(["--ops"] if ops else [])], cwd=REPO, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(f"arm {name} failed:\n{proc.stderr[-4000:]}")
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("ARM_JSON "))[9:])
    cut = [phases(r) for r in result["rows"]]
    summary = {p: statistics.median(c[p] for c in cut) for p in PHASES}
    summary["step"] = statistics.median(r["loop_step_s"] for r in result["rows"])
    if "ops" in result:
        summary["ops"] = result["ops"]
    return summary


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        model_dir, run_dir, steps, changes = argv[1:5]
        result = _arm_process(model_dir, run_dir, int(steps), [c for c in changes.split(",") if c], "--ops" in argv)
        print("ARM_JSON " + json.dumps(result, default=float))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="tiny", choices=sorted(SIZES))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    p.add_argument("--ops", action="store_true", help="the now arm's operators by group (torch.profiler)")
    p.add_argument("--trl", action="store_true", help="TRL's GRPOTrainer beside us (the trl extra)")
    p.add_argument("--out", default="runs/profile_rl_step")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    model_dir = build_model(out / args.size / "model", SIZES[args.size])
    results = {name: run_arm(model_dir, out / args.size, name, args.steps, False) for name in args.arms.split(",")}
    if args.ops:  # a run of its own: the profiler's cost stays out of the timed arms
        results.setdefault("now", {})["ops"] = run_arm(model_dir, out / args.size, "now", args.steps, True)["ops"]
    trl = None
    if args.trl:  # the same model, task and settings (bench_rl_vs_trl's), the first step left out as ours
        task = argparse.Namespace(
            steps=args.steps + 1, prompts=PROMPTS, reward=REWARD, prompts_per_step=8, samples=8, new_tokens=8
        )
        trl = run_trl(model_dir, out / args.size / "trl", task, 0)
        if args.ops:
            trl["ops"] = run_trl(model_dir, out / args.size / "trl_ops", task, 0, ops=True)["ops"]
    print(_table(args, results, trl))
    if args.json:
        print(json.dumps({"size": args.size, "steps": args.steps, "arms": results, "trl": trl}))
    return 0


def _table(args, results: dict, trl: dict | None) -> str:
    base = results["now"] if "step" in results.get("now", {}) else None
    head = f"{'arm':<14} {'step':>7} " + " ".join(f"{p:>12}" for p in PHASES) + f" {'vs now':>8}"
    lines = [f"{args.size}: seconds a step (median over {args.steps} steps, one thread)", head]
    for name, r in results.items():
        if "step" not in r:
            continue
        ratio = f"{r['step'] / base['step']:>7.2f}x" if base else ""
        lines.append(f"{name:<14} {r['step']:>7.4f} " + " ".join(f"{r[p]:>12.4f}" for p in PHASES) + f" {ratio:>8}")
    if trl is not None:
        ratio = f" ({trl['s_per_step'] / base['step']:.2f}x our now)" if base else ""
        lines.append(
            f"TRL GRPOTrainer: step {trl['s_per_step']:.4f}{ratio}, generate {trl['generate_s']:.4f}, "
            f"the rest {trl['s_per_step'] - trl['generate_s']:.4f} (scoring, advantages, training)"
        )
    ops = {name: r["ops"] for name, r in (("ours", results.get("now", {})), ("TRL", trl or {})) if "ops" in r}
    if ops:
        lines.append("self CPU seconds a step by operator group (under torch.profiler, which slows small ops):")
        lines.append(f"  {'group':<16} " + " ".join(f"{name:>8}" for name in ops))
        groups = [g for g, _ in OP_GROUPS] + ["other"]
        for g in sorted(groups, key=lambda g: -max(o[g] for o in ops.values())):
            lines.append(f"  {g:<16} " + " ".join(f"{o[g]:>8.4f}" for o in ops.values()))
        lines.append(f"  {'total':<16} " + " ".join(f"{sum(o.values()):>8.4f}" for o in ops.values()))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
