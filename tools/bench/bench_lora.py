#!/usr/bin/env python3
"""LoRA against full fine-tuning, side by side in one run, on the same model and data.

Two arms of ``--steps`` training steps each (``backend.bench.compare``'s recorded run, one process,
FP32 on this machine): ``full`` (every weight trained) and ``lora`` (``model.lora.rank=--rank`` on
all seven projections, the base frozen). Per arm:

- trained parameters, and AdamW's state for them (two FP32 moments each: 8 bytes a parameter);
- the median step time after the first step, and the peak memory of a step (the trainer's meter);
- the bytes one RL weight sync moves: every Hugging Face weight (the merged stream both the
  transformers generator and vLLM take) against the adapters alone (what an adapter-only sync to
  an engine holding the base would move: PEFT's A and B in FP32).

    python tools/bench/bench_lora.py [CONFIG] [dotted.key=value ...] [--rank 8] [--steps 4] [--json]

The default config is the quickstart's, widened to 4 layers x 512 (--small keeps its 2 x 128).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

WIDE = [
    "model.num_layers=4",
    "model.hidden_size=512",
    "model.num_attention_heads=8",
    "model.num_query_groups=4",
    "data.max_seq_length=512",
    "train.max_tokens_per_gpu=4096",
    "train.global_batch_size=16",
    "data.valid_fraction=0",
]


def counts(config: str, overrides: list[str]) -> dict:
    """Trained and total parameters and the sync bytes, from the model on the meta device."""
    from backend.config import load_config, validate
    from backend.data.tokenizers import build_tokenizer
    from backend.model.factory import meta_model
    from backend.model.lora import is_adapter

    cfg = validate(load_config(config, overrides))
    model = meta_model(cfg, tokenizer_vocab=build_tokenizer(cfg.data.tokenizer).vocab_size)
    params = list(model.named_parameters())
    trained = sum(p.numel() for _, p in params if p.requires_grad)
    adapters = sum(p.numel() for n, p in params if is_adapter(n))
    base = sum(p.numel() for n, p in params if not is_adapter(n))
    return {
        "parameters": base,
        "trained_parameters": trained,
        "optimizer_bytes": 8 * trained,
        "sync_bytes_merged": 4 * base,
        "sync_bytes_adapters": 4 * adapters if adapters else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", default="configs/quickstart.yaml")
    p.add_argument("overrides", nargs="*", default=[])
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--small", action="store_true", help="the config's own model size")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    from backend.bench.compare import run_arm
    from backend.distributed.setup import init_distributed, shutdown_distributed

    common = [*([] if args.small else WIDE), *args.overrides, "checkpoint.interval=0", "train.eval_interval=0"]
    arms = {"full": common, "lora": [*common, f"model.lora.rank={args.rank}"]}
    env = init_distributed(1)  # the meta-device build reads megatron-core's parallel state
    try:
        sizes = {name: counts(args.config, overrides) for name, overrides in arms.items()}
    finally:
        shutdown_distributed(env)
    result = {"config": args.config, "overrides": common, "rank": args.rank, "steps": args.steps, "arms": {}}
    with tempfile.TemporaryDirectory(prefix="bench_lora_") as tmp:
        for name, overrides in arms.items():
            record = run_arm(args.config, overrides, nproc=1, steps=args.steps, out_dir=Path(tmp), name=name)
            times = record["step_time_s"][1:] or record["step_time_s"]
            result["arms"][name] = {
                **sizes[name],
                "step_time_s": statistics.median(times),
                "peak_memory_bytes": int(record["peak_memory_bytes"]),
                "final_loss": record["loss"][-1],
            }
    full, lora = result["arms"]["full"], result["arms"]["lora"]
    result["lora_over_full"] = {
        k: lora[k] / full[k] for k in ("trained_parameters", "optimizer_bytes", "step_time_s", "peak_memory_bytes")
    }
    result["adapter_sync_over_merged"] = lora["sync_bytes_adapters"] / lora["sync_bytes_merged"]

    mib = 2**20
    print(f"{'arm':<6}{'trained':>14}{'optim MiB':>11}{'step s':>9}{'peak MiB':>10}{'sync MiB':>10}{'loss':>9}")
    for name, a in result["arms"].items():
        sync = a["sync_bytes_adapters"] or a["sync_bytes_merged"]
        print(
            f"{name:<6}{a['trained_parameters']:>14,}{a['optimizer_bytes'] / mib:>11.2f}{a['step_time_s']:>9.3f}"
            f"{a['peak_memory_bytes'] / mib:>10.1f}{sync / mib:>10.2f}{a['final_loss']:>9.4f}"
        )
    print(
        f"lora / full: trained {result['lora_over_full']['trained_parameters']:.4f}, step time "
        f"{result['lora_over_full']['step_time_s']:.2f}x, peak {result['lora_over_full']['peak_memory_bytes']:.2f}x; "
        f"an adapter-only sync moves {result['adapter_sync_over_merged']:.4f} of a merged one"
    )
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
