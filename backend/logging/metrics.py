"""Per-step metrics to the console (a progress line), ``metrics.jsonl`` and wandb (rank 0 only)."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import torch

from backend.batching import StepPlan


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: peak allocated bytes this step. CPU: the process's peak resident set size so far."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def plan_metrics(plan: StepPlan, dp_rank: int) -> dict:
    """The dynamic-batching diagnostics of one step's plan (``StepPlan.metrics``) plus this rank's
    padding efficiency."""
    return {**plan.metrics(), "padding_efficiency_this_rank": plan.rank_padding_efficiencies()[dp_rank]}


class MetricsLogger:
    """Writes one JSON object per step; prints a progress line; forwards to a wandb run if any."""

    def __init__(self, run_dir: str | Path, total_steps: int, *, enabled: bool, wandb_run=None, log_interval: int = 1):
        """``wandb_run`` may also be attached later (the trainer does, once it knows the run id)."""
        self.enabled = enabled
        self.total = total_steps
        self.wandb_run = wandb_run
        self.log_interval = log_interval
        self.path = Path(run_dir) / "metrics.jsonl"
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, metrics: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(metrics) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in metrics.items() if isinstance(v, int | float)}, step=metrics["step"])
        step = metrics["step"]
        if step % self.log_interval == 0 or step == self.total:
            done = int(20 * step / max(1, self.total))
            print(
                f"[{'#' * done}{'.' * (20 - done)}] step {step}/{self.total} | loss {metrics['loss']:.4f} | "
                f"{metrics['tokens_per_s']:,.0f} tok/s | {metrics['num_microbatches']} mbs | "
                f"pad eff {metrics['padding_efficiency']:.3f} | {metrics['step_time_s']:.2f} s",
                file=sys.stdout,
                flush=True,
            )

    def log_eval(self, step: int, row: dict) -> None:
        """A validation row ({"kind": "eval", "step", "valid_loss", ...}) in metrics.jsonl and wandb."""
        if not self.enabled:
            return
        row = {"kind": "eval", "step": step, **row}
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in row.items() if isinstance(v, int | float) and k != "step"}, step=step)
        print(
            f"step {step}/{self.total} | valid_loss {row['valid_loss']:.4f} on {row['valid_tokens']:,} tokens",
            flush=True,
        )
