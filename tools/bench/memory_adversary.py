#!/usr/bin/env python3
"""Adversarial steps at the budget ``train.max_tokens_per_gpu: auto`` resolves: every sequence at
the maximum length, one maximum-length sequence among short ones, only short ones. Prints a table
(and ``--json`` one object); exits 1 if a step measured over its prediction.

    python tools/bench/memory_adversary.py configs/quickstart.yaml train.memory_limit_gib=0.5 --steps 9
    python tools/bench/memory_adversary.py configs/quickstart.yaml --fraction 0.5 --steps 20   # CUDA

On CUDA, ``--fraction F`` caps the caching allocator at F of the device
(``torch.cuda.set_per_process_memory_fraction``) and sets ``train.memory_limit_gib`` to that cap, so
a budget that were too large would run out of memory, not just exceed a prediction. On CPU give
``train.memory_limit_gib``. See ``backend.bench.memory_adversary``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="dotted.key=value, as for training")
    p.add_argument("--steps", type=int, default=20, help="steps over the three phases (default 20)")
    p.add_argument("--fraction", type=float, default=0.0, help="CUDA only: cap the allocator at this fraction")
    p.add_argument("--json", action="store_true", help="print one JSON object after the table")
    p.add_argument(
        "--workdir",
        default="",
        help="rows and runs go here (default: a temporary directory; over several nodes give one every rank sees)",
    )
    args = p.parse_intermixed_args(argv)

    import torch

    from backend.bench.memory_adversary import PHASES, format_table, run_phase
    from backend.config import load_config
    from backend.distributed.setup import init_from_config, shutdown_distributed

    overrides = list(args.overrides)
    env = init_from_config(load_config(args.config, overrides))
    if args.fraction:
        if env.device.type != "cuda":
            print("error: --fraction needs a CUDA device; on CPU give train.memory_limit_gib", file=sys.stderr)
            return 2
        torch.cuda.set_per_process_memory_fraction(args.fraction, env.device)
        total = torch.cuda.get_device_properties(env.device).total_memory
        overrides.append(f"train.memory_limit_gib={total * args.fraction / 2**30:.3f}")
    per_phase = [args.steps // len(PHASES) + (i < args.steps % len(PHASES)) for i in range(len(PHASES))]
    with tempfile.TemporaryDirectory(prefix="memory_adversary_") as tmp:
        work = Path(args.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        if env.world_size > 1:
            import torch.distributed as dist

            box = [str(work)]
            dist.broadcast_object_list(
                box, src=0, group=env.group("world")
            )  # rank 0's directory for every rank (one node, or shared)
            work = Path(box[0])
        phases = [run_phase(args.config, overrides, kind, n, work, env) for kind, n in zip(PHASES, per_phase) if n]
        if env.world_size > 1:
            dist.barrier(group=env.group("world"))  # no rank still reads rank 0's directory when it is removed
    ok = all(p["within_prediction"] for p in phases)
    if env.is_main:
        print(format_table(phases))
        print("every step at or under its prediction" if ok else "a step measured over its prediction")
        if args.json:
            print(json.dumps({"ok": ok, "phases": phases}))
    shutdown_distributed(env)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
