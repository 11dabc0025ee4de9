#!/usr/bin/env python3
"""Fixed versus dynamic microbatching: the validation table, for any config, CPU or GPU.

    python tools/compare_arms.py configs/quickstart.yaml --steps 3 --json
    python tools/compare_arms.py configs/quickstart.yaml --nproc 4 parallel.context_parallel_size=2

The fixed arm runs micro-batch size --fixed-mbs (1 by default) with dynamic batching off; the
dynamic arm runs the config's budget (in its train.dynamic_batch_layout). Same seed, same
windows, same initial weights. --packed adds a third arm, dynamic with the packed layout, compared
with the fixed arm under "packed" in the JSON. With loss.type=policy the table also shows each
arm's policy metrics (pg_loss, clipfrac, kl, ...) and their worst relative difference:

    python tools/compare_arms.py configs/quickstart.yaml --packed loss.type=policy data.path=rollouts.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from backend.bench.compare import compare, run_arm  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="the YAML config both arms train (as for python -m backend.train)")
    p.add_argument("overrides", nargs="*", default=[], help="dotted.key=value, applied to both arms (optional)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps each arm trains (default 3)")
    p.add_argument("--nproc", type=int, default=2, help="processes per arm (dp * cp)")
    p.add_argument("--fixed-mbs", type=int, default=1, help="the fixed arm's train.micro_batch_size (default 1)")
    p.add_argument("--out-dir", help="where arm runs and records go (default: a temporary folder)")
    p.add_argument("--packed", action="store_true", help="add a dynamic arm with the packed layout")
    p.add_argument("--json", action="store_true", help="print one JSON object (the comparison's numbers) at the end")
    args = p.parse_intermixed_args(argv)  # dotted overrides before or after the flags
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="compare_arms_"))
    common = dict(nproc=args.nproc, steps=args.steps, out_dir=out_dir)
    fixed = run_arm(
        args.config,
        [*args.overrides, "train.dynamic_batch_enable=false", f"train.micro_batch_size={args.fixed_mbs}"],
        name="fixed",
        **common,
    )
    dynamic = run_arm(args.config, [*args.overrides, "train.dynamic_batch_enable=true"], name="dynamic", **common)
    result = {
        "config": args.config,
        "overrides": args.overrides,
        "nproc": args.nproc,
        "fixed_mbs": args.fixed_mbs,
        **compare(fixed, dynamic),
    }
    arms = {"fixed": fixed, "dynamic": dynamic}
    if args.packed:
        packed_overrides = ["train.dynamic_batch_enable=true", "train.dynamic_batch_layout=packed"]
        arms["packed"] = run_arm(args.config, [*args.overrides, *packed_overrides], name="packed", **common)
        result["packed"] = compare(fixed, arms["packed"])
    print(f"{'step':>4} " + " ".join(f"{'loss ' + name:>14}" for name in arms))
    for i in range(result["steps"]):
        print(f"{i + 1:>4} " + " ".join(f"{arm['loss'][i]:14.8f}" for arm in arms.values()))
    print_table(result, "dynamic")
    if args.packed:
        print_table(result["packed"], "packed")
    if args.json:
        print(json.dumps(result))
    return 0


def print_table(result: dict, name: str) -> None:
    """The agreement of one arm with the fixed arm, and (policy loss) each metric's worst difference."""
    print(f"-- fixed vs {name}")
    rows = [
        ("loss_rel_diff", f"{result['loss_rel_diff']:.3e}"),
        ("grad_cosine", f"{result['grad_cosine']:.8f}"),
        ("update_cosine", f"{result['update_cosine']:.8f}"),
        ("rel_update_diff", f"{result['rel_update_diff']:.3e}"),
        ("max_param_diff", f"{result['max_param_diff']:.3e}"),
        (f"step_time_ratio (fixed/{name})", f"{result['step_time_ratio']:.2f}"),
        (f"peak_memory_diff_bytes (fixed-{name})", f"{result['peak_memory_diff_bytes']:,}"),
        (
            f"microbatches/step fixed, {name}",
            f"{result['num_microbatches_ref']:.1f}, {result['num_microbatches_other']:.1f}",
        ),
        (
            f"padding efficiency fixed, {name}",
            f"{result['padding_efficiency_ref']:.3f}, {result['padding_efficiency_other']:.3f}",
        ),
    ]
    rows += [(f"{key} rel diff", f"{value:.3e}") for key, value in result.get("metric_rel_diff", {}).items()]
    for k, v in rows:
        print(f"{k:<42} {v}")


if __name__ == "__main__":
    sys.exit(main())
