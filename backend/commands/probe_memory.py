#!/usr/bin/env python3
"""Measure a model's memory per microbatch and print the token budget that fits (what
``train.max_tokens_per_gpu: auto`` resolves to at start-up).

    python tools/probe_memory.py configs/quickstart.yaml train.memory_limit_gib=2 [--json]
    torchrun --nproc-per-node 8 tools/probe_memory.py configs/qwen3_4b_dynamic.yaml --json

Builds the model, FSDP2 wrapping and optimizer as training does (no checkpoint is read), runs the
probe microbatches (``backend.train.memory_probe``) and prints the fit ``peak = a + b x tokens +
c x attention pairs``, each probe's measurement, the limit, the budget and the worst microbatch's
predicted peak. ``--json`` prints one object with ``max_tokens_per_gpu``, ``a_bytes``,
``b_bytes_per_token``, ``c_bytes_per_token_len``, ``limit_bytes``, ``predicted_peak_bytes``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="dotted.key=value, as for training")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_intermixed_args(argv)

    from backend.batching.memory_fit import BudgetError
    from backend.config import load_config, validate
    from backend.data.tokenizers import build_tokenizer
    from backend.distributed.setup import init_from_config, shutdown_distributed
    from backend.errors import UserError
    from backend.model.factory import build_model
    from backend.train.memory_meter import MemoryMeter, resident_tensors
    from backend.train.memory_probe import probe_memory
    from backend.train.optim import build_optimizer

    try:
        cfg = load_config(args.config, args.overrides)
        cfg = validate(cfg, int(os.environ.get("WORLD_SIZE", "1")))  # a config error before any group forms
        env = init_from_config(cfg)
        tokenizer = build_tokenizer(cfg.data.tokenizer, eod=cfg.data.append_eod)  # the run's vocabulary
        built = build_model(cfg, env, tokenizer_vocab=tokenizer.vocab_size)
        optimizer = build_optimizer(built.model, cfg.optimizer)
        meter = MemoryMeter(env.device, resident_tensors(built.model, optimizer))
        result = probe_memory(built.model, optimizer, cfg, env, backend=built.attention_backend, meter=meter)
    except (UserError, BudgetError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if env.is_main:
        if args.json:
            print(json.dumps(result.as_dict()))
        else:
            print(result.summary())
            for tokens, area, peak in result.points:
                print(f"  probe: {tokens:>9,.0f} tokens, {area:>13,.0f} attention pairs: {peak / 2**20:>9,.1f} MiB")
    shutdown_distributed(env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
