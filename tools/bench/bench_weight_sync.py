#!/usr/bin/env python3
"""Weight sync to the RL generator, side by side in one run: the in-process Hugging Face stream
against the file round trip it replaces.

    python tools/bench/bench_weight_sync.py [CONFIG] [dotted.key=value ...] [--repeats 5] [--json]

- ``stream``: ``generator.load_weights(worker.hf_weights())``: each FSDP2 parameter gathered,
  converted to Hugging Face names and copied into the generator's model, never a file;
- ``files``: what a loop without it does per rollout batch: save a checkpoint, export it
  (``tools/export_hf.py``'s library call) and load the directory with ``from_pretrained``.

Both arms give the generator the same weights (checked bitwise on the logits of one prompt).
Prints a table and, with --json, one JSON object: per arm the median seconds over --repeats and
the bytes moved, and ``files_over_stream``. The default config is the GRPO demo's (2 x 128, 1.7
MB); pass e.g. ``model.num_layers=8 model.hidden_size=512`` for a larger model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", default="configs/grpo_demo.yaml")
    p.add_argument("overrides", nargs="*", default=[])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    import logging

    import torch

    logging.basicConfig(level=logging.WARNING)
    from transformers import AutoModelForCausalLM

    from backend.checkpoint.hf_export import export_checkpoint
    from backend.generators.hf import HFGenerator
    from backend.rl import PolicyWorker

    with tempfile.TemporaryDirectory(prefix="bench_weight_sync_") as tmp:
        overrides = [*args.overrides, f"logger.run_dir={tmp}/run", "checkpoint.resume=false", "checkpoint.keep_last=1"]
        worker = PolicyWorker.from_config(args.config, overrides)
        try:
            gen = HFGenerator.from_worker(worker)
            probe = torch.tensor([list(range(1, 33))])
            stream_s, stream_bytes = [], 0
            for _ in range(args.repeats):
                stats = gen.load_weights(worker.hf_weights())
                stream_s.append(stats.seconds)
                stream_bytes = stats.bytes
            files_s, files_bytes, loaded = [], 0, None
            for i in range(args.repeats):
                start = time.perf_counter()
                step_dir = worker.save()
                out = export_checkpoint(step_dir, worker.cfg, Path(tmp) / f"hf{i}", worker.env, dtype="fp32")
                loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="sdpa")
                files_s.append(time.perf_counter() - start)
                files_bytes = sum(f.stat().st_size for f in Path(step_dir).iterdir()) + sum(
                    f.stat().st_size for f in out.glob("*.safetensors")
                )
            with torch.no_grad():
                same = torch.equal(gen.logits(probe), loaded.eval()(input_ids=probe).logits.float())
            params = sum(p.numel() for p in gen.model.parameters())
        finally:
            worker.close()
    result = {
        "config": args.config,
        "overrides": args.overrides,
        "parameters": params,
        "repeats": args.repeats,
        "same_logits": same,
        "arms": {
            "stream": {"median_s": statistics.median(stream_s), "bytes": stream_bytes},
            "files": {"median_s": statistics.median(files_s), "bytes_written": files_bytes},
        },
    }
    result["files_over_stream"] = result["arms"]["files"]["median_s"] / result["arms"]["stream"]["median_s"]
    print(f"{params:,} parameters, {args.repeats} repeats, same logits: {same}")
    print(f"{'arm':8} {'median s':>10} {'MB':>10}")
    print(f"{'stream':8} {result['arms']['stream']['median_s']:10.4f} {stream_bytes / 1e6:10.1f}")
    print(f"{'files':8} {result['arms']['files']['median_s']:10.4f} {files_bytes / 1e6:10.1f}")
    print(f"files / stream: {result['files_over_stream']:.1f}x")
    if args.json:
        print(json.dumps(result))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
