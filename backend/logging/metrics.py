"""Per-step metrics to the console (``console.ProgressDisplay``), ``metrics.jsonl`` and wandb (rank 0 only).

``metrics.jsonl`` holds one JSON object a line: a training step's metrics (``step``, ``loss``, ...)
or, for an evaluation, ``{"event": "eval", "step": N, "valid_loss": ..., ...}`` written after the
row of the step it evaluated. ``read_metrics`` splits the two kinds.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from backend.batching import StepPlan

from .console import ProgressDisplay, format_eval_line, run_totals

EVAL_EVENT = "eval"


def plan_metrics(plan: StepPlan, dp_rank: int) -> dict:
    """The dynamic-batching diagnostics of one step's plan (``StepPlan.metrics``) plus this rank's
    padding efficiency."""
    return {**plan.metrics(), "padding_efficiency_this_rank": plan.rank_padding_efficiencies()[dp_rank]}


def read_metrics(path: str | Path) -> tuple[list[dict], list[dict]]:
    """(training-step rows, evaluation rows) of a metrics.jsonl; other and unreadable lines are skipped."""
    train, evals = [], []
    path = Path(path)
    if not path.is_file():
        return train, evals
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # e.g. a last line cut by a kill
        if not isinstance(row, dict) or "step" not in row:
            continue
        if row.get("event") == EVAL_EVENT:
            evals.append(row)
        elif "event" not in row:
            train.append(row)
    return train, evals


class MetricsLogger:
    """Writes one JSON object per step; shows progress on the console; forwards to a wandb run if any."""

    def __init__(self, run_dir: str | Path, total_steps: int, *, enabled: bool, wandb_run=None, log_interval: int = 1):
        """``wandb_run`` may also be attached later (the trainer does, once it knows the run id)."""
        self.enabled = enabled
        self.total = total_steps
        self.wandb_run = wandb_run
        self.log_interval = log_interval
        self.path = Path(run_dir) / "metrics.jsonl"
        self.started = time.monotonic()
        self.display: ProgressDisplay | None = None  # made at the first step (a resumed run's bar starts there)
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def _display(self, done: int) -> ProgressDisplay:
        """The progress display, made when first needed with ``done`` steps already behind it."""
        if self.display is None:
            self.display = ProgressDisplay(
                self.total, start_step=done, log_interval=self.log_interval, started=self.started
            )
        return self.display

    def log(self, metrics: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(metrics) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in metrics.items() if isinstance(v, int | float)}, step=metrics["step"])
        self._display(metrics["step"] - 1).update(metrics)

    def log_eval(self, step: int, metrics: dict) -> None:
        """An evaluation after ``step``: ``metrics`` holds ``valid_loss`` (and e.g. ``valid_tokens``).
        Written to metrics.jsonl as ``{"event": "eval", "step": step, ...}``, sent to wandb under
        the same names and printed as one line."""
        if not self.enabled:
            return
        row = {"event": EVAL_EVENT, "step": step, **metrics}
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in metrics.items() if isinstance(v, int | float)}, step=step)
        self._display(step).print(format_eval_line(step, metrics))

    def totals(self) -> dict:
        """The run's totals so far from metrics.jsonl (``console.run_totals``), for the end summary."""
        return run_totals(*read_metrics(self.path))

    def close(self) -> None:
        """Stop the progress display (it stops by itself after the last step)."""
        if self.display is not None:
            self.display.close()
