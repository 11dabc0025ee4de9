"""Adversarial windows at the measured budget: does ``train.max_tokens_per_gpu: auto`` hold where
it is most likely to break?

Three phases of synthetic token rows (a JSONL of ``input_ids``), each trained by the real trainer
with ``auto`` (so each probes, plans, runs and meters exactly as a user's run):

- ``long``: every sequence at ``data.max_seq_length``: full budgets of the longest rows, the
  largest attention area a budget can hold;
- ``singleton``: one max-length sequence per window among short ones: a microbatch holding the
  longest sequence beside the many-row microbatches;
- ``short``: only short sequences (16-64 tokens): the most rows per budget.

Each phase's data set is exactly one window of rows (``train.global_batch_size``), trained for
as many epochs as steps, so every window holds the phase's mix whatever the sampler's permutation
(one maximum-length row per window in ``singleton``, not one on average). Each step's measured
peak (``peak_memory_bytes``, the trainer's meter) is compared with the fit's prediction for that
step's largest microbatch, on every rank (``peak_over_prediction_max_rank``); the run must not run
out of memory, and no step may measure over its prediction. No checkpoint is written. ``tight``
reports whether 1.15x the budget would be predicted over the limit itself, i.e. the budget leaves
no large slack (unless it was capped at a window's tokens). On CUDA the caller may cap the allocator
(``torch.cuda.set_per_process_memory_fraction``) so the limit is enforced, not just predicted.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

PHASES = ("long", "singleton", "short")


def adversarial_rows(kind: str, count: int, max_len: int, seed: int = 0) -> list[dict]:
    """One window's ``count`` rows of token ids in [1, 200) (within any tokenizer's vocabulary)."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(count):
        if kind == "long" or (kind == "singleton" and i == 0):
            n = max_len
        else:
            n = int(rng.integers(16, 65))
        rows.append({"input_ids": rng.integers(1, 200, n).tolist()})
    return rows


def run_phase(config: str, overrides: list[str], kind: str, steps: int, workdir: Path, env) -> dict:
    """Train ``steps`` steps of one phase with ``auto``; the per-step peaks and predictions.
    ``workdir`` must be one directory every rank sees (rank 0 writes the rows, rank 0 the metrics)."""
    import gc

    import torch
    import torch.distributed as dist

    from backend.batching.memory_fit import worst_peak
    from backend.config import load_config, validate
    from backend.train.trainer import Trainer

    base = validate(load_config(config, overrides), env.world_size)
    per_window = base.train.global_batch_size
    data = workdir / f"{kind}.jsonl"
    rows = adversarial_rows(kind, per_window, base.data.max_seq_length)
    if env.is_main:
        data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    run = workdir / kind
    cfg = load_config(
        config,
        [
            *overrides,
            f"data.path={data}",
            "data.valid_fraction=0",
            "data.overlong=truncate",
            f"data.cache_dir={workdir / 'cache'}",
            "train.dynamic_batch_enable=true",
            "train.max_tokens_per_gpu=auto",
            f"train.train_iters={steps}",
            "train.eval_interval=0",
            f"logger.run_dir={run}",
            f"checkpoint.dir={run / 'checkpoints'}",
            "checkpoint.resume=false",
            "checkpoint.interval=0",
            "logger.wandb.mode=disabled",
        ],
    )
    if env.world_size > 1:
        dist.barrier(group=env.group("world"))  # the rows file is written before any rank reads it
    trainer = Trainer(validate(cfg, env.world_size), env)
    trainer.should_save = lambda: False  # a benchmark: no checkpoint (interval 0 still saves the last step)
    budget = trainer.cfg.train.max_tokens_per_gpu
    memory = trainer.memory
    trainer.train()
    trainer.metrics.close()
    final_budget = trainer.cfg.train.max_tokens_per_gpu
    del trainer  # the next phase probes and trains on a device free of this one
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if env.world_size > 1:
        dist.barrier(group=env.group("world"))  # rank 0's metrics.jsonl is complete before any rank reads it
    steps_out = [
        {
            k: r[k]
            for k in ("step", "peak_memory_bytes", "predicted_peak_bytes", "peak_over_prediction_max_rank")
            if k in r
        }
        for r in (json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines())
        if "loss" in r
    ]
    limit = memory.limit_bytes
    over_limit_at = worst_peak(memory.fit, 1.15 * budget, base.data.max_seq_length, env.cp_size * env.sp_size)
    ratios = [s["peak_over_prediction_max_rank"] for s in steps_out]  # the worst rank's, each step
    return {
        "phase": kind,
        "budget": budget,
        "final_budget": final_budget,
        "limit_bytes": limit,
        "steps": steps_out,
        "worst_peak_bytes": max(s["peak_memory_bytes"] for s in steps_out),
        "worst_ratio": max(ratios),
        "within_prediction": all(r <= 1.0 for r in ratios),
        "tight": over_limit_at > limit,
        "predicted_at_1.15x_bytes": over_limit_at,
    }


def format_table(phases: list[dict]) -> str:
    head = f"{'phase':<10} {'budget':>8} {'steps':>5} {'worst peak':>12} {'peak/pred':>9} {'limit':>10}  1.15x over"
    lines = [head, "-" * len(head)]
    for p in phases:
        lines.append(
            f"{p['phase']:<10} {p['budget']:>8,} {len(p['steps']):>5} {p['worst_peak_bytes'] / 2**20:>8,.1f} MiB "
            f"{p['worst_ratio']:>9.3f} {p['limit_bytes'] / 2**20:>6,.0f} MiB  {'yes' if p['tight'] else 'no'}"
        )
    return "\n".join(lines)
