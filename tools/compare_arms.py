#!/usr/bin/env python3
"""Fixed versus dynamic microbatching: the validation table, for any config, CPU or GPU.

    python tools/compare_arms.py configs/quickstart.yaml --steps 3 --json
    python tools/compare_arms.py configs/quickstart.yaml --nproc 4 parallel.context_parallel_size=2

The fixed arm runs micro-batch size --fixed-mbs (1 by default) with dynamic batching off; the
dynamic arm runs the config's budget. Same seed, same windows, same initial weights.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.bench.compare import compare, run_arm  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="dotted.key=value, applied to both arms")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2, help="processes per arm (dp * cp)")
    p.add_argument("--fixed-mbs", type=int, default=1)
    p.add_argument("--out-dir", help="where arm runs and records go (default: a temporary folder)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
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
    print(f"{'step':>4} {'loss fixed':>12} {'loss dynamic':>13}")
    for i, (a, b) in enumerate(zip(result["loss_ref"], result["loss_other"]), 1):
        print(f"{i:>4} {a:12.6f} {b:13.6f}")
    rows = [
        ("loss_rel_diff", f"{result['loss_rel_diff']:.3e}"),
        ("grad_cosine", f"{result['grad_cosine']:.8f}"),
        ("update_cosine", f"{result['update_cosine']:.8f}"),
        ("rel_update_diff", f"{result['rel_update_diff']:.3e}"),
        ("max_param_diff", f"{result['max_param_diff']:.3e}"),
        ("step_time_ratio (fixed/dynamic)", f"{result['step_time_ratio']:.2f}"),
        ("peak_memory_diff_bytes (fixed-dynamic)", f"{result['peak_memory_diff_bytes']:,}"),
        (
            "microbatches/step fixed, dynamic",
            f"{result['num_microbatches_ref']:.1f}, {result['num_microbatches_other']:.1f}",
        ),
        (
            "padding efficiency fixed, dynamic",
            f"{result['padding_efficiency_ref']:.3f}, {result['padding_efficiency_other']:.3f}",
        ),
    ]
    for k, v in rows:
        print(f"{k:<42} {v}")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
