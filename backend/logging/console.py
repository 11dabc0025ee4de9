"""What the console shows: a progress display per step, a start-up summary and an end-of-run summary.

On a terminal the progress display is a ``rich`` progress bar redrawn in place (step, bar, elapsed,
ETA, and the last step's loss, gradient norm, lr, tokens/s, microbatches, padding efficiency and
step time); evaluation results and every ``log_interval``-th step (when above 1) are printed above
it and stay in the scroll-back. Piped into a file or a log collector (no terminal), it prints one
plain line per logged step instead, with the same numbers and elapsed / ETA, and no control codes,
so ``grep loss`` and ``tail -f`` work on Slurm output files.

The summaries are functions of plain dicts (the trainer gathers the numbers) returning text, so
they can be logged, printed or tested alike.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import sys
import time
from collections.abc import Iterable, Sequence

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn
from rich.text import Text


def format_duration(seconds: float | None) -> str:
    """``1:02:03`` / ``02:03``; ``--:--`` when unknown."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "--:--"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def _num(value, fmt: str) -> str | None:
    return None if value is None else format(value, fmt)


def format_step_stats(metrics: dict) -> str:
    """The numbers of one step: ``loss 2.3456 | gnorm 1.23 | lr 3.00e-04 | 12,345 tok/s | 4 mbs | pad eff 0.912 |
    1.23 s/step`` (a missing key is left out)."""
    parts = [
        ("loss", _num(metrics.get("loss"), ".4f")),
        ("gnorm", _num(metrics.get("grad_norm"), ".3g")),
        ("lr", _num(metrics.get("lr"), ".2e")),
    ]
    out = [f"{name} {value}" for name, value in parts if value is not None]
    if metrics.get("reward_mean") is not None:  # the RL loop: its reward and the sampler's view
        out.insert(0, f"reward {metrics['reward_mean']:.3f}")
        if metrics.get("response_length_mean") is not None:
            out.append(f"resp {metrics['response_length_mean']:.1f} tok")
    if metrics.get("vf_loss") is not None and metrics.get("reward_mean") is not None:  # PPO's critic
        out.append(f"vf {metrics['vf_loss']:.4f} ev {metrics['explained_variance']:.3f}")
    if metrics.get("token_mult_prob_error") is not None:  # sampler vs trainer (1 = the same numbers)
        out.append(f"mismatch {metrics['token_mult_prob_error']:.4f}")
    if metrics.get("clipfrac") is not None:  # the policy loss: how much of the window was clipped
        out.append(f"clipfrac {metrics['clipfrac']:.3f}")
    if metrics.get("tokens_per_s") is not None:
        out.append(f"{metrics['tokens_per_s']:,.0f} tok/s")
    if metrics.get("num_microbatches") is not None:
        out.append(f"{metrics['num_microbatches']} mbs")
    if metrics.get("padding_efficiency") is not None:
        out.append(f"pad eff {metrics['padding_efficiency']:.3f}")
    if metrics.get("step_time_s") is not None:
        out.append(f"{metrics['step_time_s']:.2f} s/step")
    return " | ".join(out)


def format_eval_line(step: int, metrics: dict) -> str:
    """``eval @ step 100 | valid_loss 2.3456 | ...`` (numbers as 4 decimals, the rest as is)."""
    items = [f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items() if k != "step"]
    return " | ".join([f"eval @ step {step}", *items])


def is_interactive(stream) -> bool:
    """A terminal that can redraw in place (not a pipe, file or TERM=dumb)."""
    try:
        return bool(stream.isatty()) and os.environ.get("TERM", "") != "dumb"
    except (AttributeError, ValueError):  # closed or file-like without isatty
        return False


class _ElapsedColumn(ProgressColumn):
    """Wall time since the run started (rich's own column counts from the bar's first draw)."""

    def __init__(self, started: float):
        super().__init__()
        self.started = started

    def render(self, task) -> Text:
        return Text(format_duration(time.monotonic() - self.started), style="progress.elapsed")


class _TwoLineProgress(Progress):
    """The bar on one line, the last step's numbers on the next (they would not fit beside it)."""

    def get_renderables(self):
        yield self.make_tasks_table(self.tasks)
        for task in self.tasks:
            if task.fields.get("stats"):
                yield Text("  " + task.fields["stats"], no_wrap=True, overflow="ellipsis")


class ProgressDisplay:
    """Per-step progress: redrawn in place on a terminal, one line per logged step otherwise.

    ``start_step`` is the step a resumed run starts after, so the bar and the ETA cover this run's
    remaining steps; ``started`` the monotonic time the run started (elapsed counts from it).
    The ETA is the remaining steps at the pace measured since the first step shown (wall clock,
    so data loading, logging and checkpoints count). ``interactive`` overrides the terminal detection.
    """

    def __init__(
        self,
        total_steps: int,
        *,
        start_step: int = 0,
        log_interval: int = 1,
        stream=None,
        interactive: bool | None = None,
        started: float | None = None,
    ):
        self.total = total_steps
        self.start_step = start_step
        self.log_interval = max(1, log_interval)
        self.stream = stream if stream is not None else sys.stdout
        self.interactive = is_interactive(self.stream) if interactive is None else interactive
        # Our own decision, passed on: rich would otherwise take FORCE_COLOR / TTY_COMPATIBLE from the
        # environment and draw a live bar into a pipe.
        self.console = Console(
            file=self.stream,
            force_terminal=self.interactive,
            force_interactive=self.interactive,
            soft_wrap=not self.interactive,
            highlight=False,
        )
        self.started = time.monotonic() if started is None else started
        self._first: tuple[int, float, float] | None = None  # (step, monotonic time, its step_time_s)
        self._progress: Progress | None = None
        self._task = None
        self.closed = False

    # ---- terminal ------------------------------------------------------------------------
    def _start_bar(self) -> None:
        self._progress = _TwoLineProgress(
            TextColumn("step"),
            MofNCompleteColumn(),
            BarColumn(bar_width=30),
            TextColumn("elapsed"),
            _ElapsedColumn(self.started),
            TextColumn("eta {task.fields[eta]}"),
            console=self.console,
            refresh_per_second=2,
            transient=False,
        )
        self._task = self._progress.add_task("train", total=self.total, completed=self.start_step, stats="", eta="")
        self._progress.start()
        atexit.register(self.close)  # a run that stops early must not leave the cursor hidden
        # While the bar is live, rich routes sys.stdout / sys.stderr writes above it; logging handlers
        # hold the original streams, so point them at the routed ones until close() (else a warning
        # mid-run would tear the bar).
        self._handlers = []
        for handler in logging.getLogger().handlers:
            stream = getattr(handler, "stream", None)
            if isinstance(handler, logging.StreamHandler) and stream in (sys.__stderr__, sys.__stdout__):
                routed = sys.stderr if stream is sys.__stderr__ else sys.stdout
                if routed is not stream:
                    self._handlers.append((handler, handler.setStream(routed)))

    # ---- both ----------------------------------------------------------------------------
    def eta_seconds(self, step: int) -> float | None:
        """Remaining time at the pace since the first step shown (that step's own time before a second)."""
        if self._first is None:
            return None
        first, at, first_time = self._first
        pace = (time.monotonic() - at) / (step - first) if step > first else first_time
        return pace * max(0, self.total - step) if pace else None

    def format_line(self, metrics: dict) -> str:
        step = metrics["step"]
        elapsed = format_duration(time.monotonic() - self.started)
        head = f"step {step}/{self.total} | elapsed {elapsed} | eta {format_duration(self.eta_seconds(step))}"
        stats = format_step_stats(metrics)
        return f"{head} | {stats}" if stats else head

    def update(self, metrics: dict) -> None:
        """Show step ``metrics['step']`` (a dict as written to metrics.jsonl)."""
        if self.closed:
            return
        step = metrics["step"]
        if self._first is None:
            self._first = (step, time.monotonic(), float(metrics.get("step_time_s") or 0.0))
        due = step % self.log_interval == 0 or step == self.total
        if self.interactive:
            if self._progress is None:
                self._start_bar()
            eta = format_duration(self.eta_seconds(step))
            self._progress.update(self._task, completed=step, stats=format_step_stats(metrics), eta=eta, refresh=True)
            if due and self.log_interval > 1:
                self._progress.console.print(self.format_line(metrics), markup=False)
            if step >= self.total:
                self.close()
        elif due:
            self.console.print(self.format_line(metrics), markup=False)
            self.stream.flush()

    def print(self, line: str) -> None:
        """A line that stays (above the bar on a terminal)."""
        console = self._progress.console if self._progress is not None else self.console
        console.print(line, markup=False)
        if not self.interactive:
            self.stream.flush()

    def close(self) -> None:
        """Stop redrawing (leaves the last bar on screen); safe to call twice."""
        if self._progress is not None:
            self._progress.refresh()
            self._progress.stop()
            self._progress = None
            for handler, stream in self._handlers:
                handler.setStream(stream)
        self.closed = True


# ---- summaries -------------------------------------------------------------------------------


def length_stats(lengths: Iterable[int]) -> dict:
    """count, tokens, mean, min, p50, p90, p99, max of sample lengths (nearest-rank percentiles;
    one sort, about a second for 10 million lengths)."""
    values = np.sort(np.asarray(list(lengths) if not hasattr(lengths, "__len__") else lengths, dtype=np.int64))
    if not len(values):
        return {"count": 0}

    def pct(q: float) -> int:
        return int(values[min(len(values), max(1, math.ceil(q / 100 * len(values)))) - 1])

    return {
        "count": int(len(values)),
        "tokens": int(values.sum()),
        "mean": float(values.mean()),
        "min": int(values[0]),
        "p50": pct(50),
        "p90": pct(90),
        "p99": pct(99),
        "max": int(values[-1]),
    }


def _human(n: float) -> str:
    """12.3M, 4.0B, 950 (parameters and token counts)."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}"


def _block(title: str, rows: list[tuple[str, str]]) -> str:
    rows = [(k, v) for k, v in rows if v not in (None, "")]
    width = max((len(k) for k, _ in rows), default=0)
    return "\n".join([title, *(f"  {k.ljust(width)}  {v}" for k, v in rows)])


def format_startup_summary(info: dict) -> str:
    """The run at a glance, before the first step. Keys (any may be missing):

    ``model`` (name or kind, e.g. "qwen3 2x128" or an HF checkpoint), ``parameters`` (int),
    ``dp``, ``cp``, ``world_size``, ``device``, ``precision``, ``attention_backend``,
    ``data_source``, ``lengths`` (a ``length_stats`` dict or a list of lengths),
    ``max_seq_length``, ``global_batch_size``, ``train_iters``, ``start_step`` (resumed from),
    ``batching`` (a dict: ``dynamic`` bool, ``max_tokens_per_gpu``, ``micro_batch_size``),
    ``schedule`` (text), ``run_dir``, ``validation`` (text), ``loss`` (text), ``ignored_fields``
    (text: row fields nothing reads), ``experts`` (text: where an MoE model's experts live),
    ``tensor_parallel`` (text: the TP groups and sequence parallelism).
    """
    rows: list[tuple[str, str]] = []
    model = info.get("model")
    if info.get("parameters") is not None:
        params = f"{_human(info['parameters'])} parameters ({info['parameters']:,})"
        model = f"{model}, {params}" if model else params
    rows.append(("model", model))
    parallel = []
    if info.get("dp") is not None:
        split = f"dp {info['dp']} x cp {info.get('cp', 1)}"
        sizes = info.get("parallel") or {}  # ParallelDims.sizes(): the dimensions beyond dp x cp when used
        split += "".join(f" x {k} {sizes[k]}" for k in ("tp", "pp") if sizes.get(k, 1) > 1)
        if sizes.get("ep", 1) > 1:
            split += f", ep {sizes['ep']}"
        parallel.append(split)
    if info.get("world_size") is not None:
        parallel.append(f"{info['world_size']} rank(s)")
    if info.get("device"):
        parallel.append(str(info["device"]))
    if info.get("precision"):
        parallel.append(str(info["precision"]))
    rows.append(("parallel", ", ".join(parallel)))
    if info.get("experts"):
        rows.append(("experts", info["experts"]))
    if info.get("tensor_parallel"):
        rows.append(("tensor parallel", info["tensor_parallel"]))
    attention = info.get("attention_backend")
    if info.get("recompute") not in (None, "none"):
        attention = f"{attention}, recompute {info['recompute']}"
    rows.append(("attention", attention))
    if info.get("logits_chunk_tokens"):
        rows.append(("output", f"logits {info['logits_chunk_tokens']:,} tokens at a time (never whole)"))
    lengths = info.get("lengths")
    if lengths is not None and not isinstance(lengths, dict):
        lengths = length_stats(lengths)
    data = info.get("data_source") or ""
    if lengths and lengths.get("count"):
        data += (
            f"{', ' if data else ''}{lengths['count']:,} samples, {_human(lengths.get('tokens', 0))} tokens; "
            f"length mean {lengths['mean']:.0f}, p50 {lengths['p50']}, p90 {lengths['p90']}, max {lengths['max']}"
        )
    if info.get("max_seq_length"):
        data += f" (max_seq_length {info['max_seq_length']})"
    rows.append(("data", data))
    if info.get("ignored_fields"):
        rows.append(("ignored", f"row fields nothing reads: {info['ignored_fields']}"))
    if info.get("validation"):
        rows.append(("validation", info["validation"]))
    batching = info.get("batching") or {}
    if batching:
        if batching.get("dynamic"):
            budget = f"dynamic, {batching.get('max_tokens_per_gpu', 0):,} tokens/GPU per microbatch"
        else:
            budget = f"fixed micro-batch size {batching.get('micro_batch_size', 1)}"
    else:
        budget = ""
    if info.get("global_batch_size"):
        budget = f"{info['global_batch_size']} samples/step" + (f", {budget}" if budget else "")
    rows.append(("batching", budget))
    steps = ""
    if info.get("train_iters"):
        steps = f"{info['train_iters']}"
        if info.get("start_step"):
            steps += f" (resuming after step {info['start_step']})"
    rows.append(("steps", steps))
    rows.append(("loss", info.get("loss")))
    if info.get("lora"):
        rows.append(("lora", info["lora"]))
    rows.append(("schedule", info.get("schedule")))
    rows.append(("run dir", info.get("run_dir")))
    return _block("run", rows)


def run_totals(train_rows: Sequence[dict], eval_rows: Sequence[dict] = ()) -> dict:
    """End-of-run numbers from metrics.jsonl rows (``read_metrics``): steps, tokens, mean
    tokens/s (tokens over summed step time), padding efficiency (real over padded tokens),
    final train loss, final and best valid loss with its step."""
    out: dict = {"steps": len(train_rows)}
    if train_rows:
        tokens = sum(r.get("tokens", 0) for r in train_rows)
        padded = sum(r.get("padded_tokens", 0) for r in train_rows)
        step_time = sum(r.get("step_time_s", 0.0) for r in train_rows)
        out.update(
            last_step=train_rows[-1].get("step"),
            tokens=tokens,
            step_time_s=step_time,
            tokens_per_s=tokens / step_time if step_time else None,
            padding_efficiency=tokens / padded if padded else None,
            final_loss=train_rows[-1].get("loss"),
        )
        peaks = [(r["peak_memory_bytes"], r.get("step")) for r in train_rows if r.get("peak_memory_bytes")]
        if peaks:
            out["peak_memory_bytes"], out["peak_memory_step"] = max(peaks)
    valid = [r for r in eval_rows if r.get("valid_loss") is not None]
    if valid:
        best = min(valid, key=lambda r: r["valid_loss"])
        out.update(
            final_valid_loss=valid[-1]["valid_loss"], best_valid_loss=best["valid_loss"], best_valid_step=best["step"]
        )
    return out


def format_end_summary(info: dict) -> str:
    """The run's outcome. Keys (any may be missing): ``status`` ("finished", "preempted"),
    ``steps``, ``last_step``, ``tokens``, ``wall_time_s``, ``tokens_per_s``, ``padding_efficiency``,
    ``final_loss``, ``final_valid_loss``, ``best_valid_loss``, ``best_valid_step``, ``checkpoint``,
    ``run_dir``: ``run_totals(...)`` plus what the trainer knows."""
    rows: list[tuple[str, str]] = []
    steps = ""
    if info.get("steps") is not None:
        steps = f"{info['steps']}"
        if info.get("last_step") is not None and info["last_step"] != info["steps"]:
            steps += f" logged, last step {info['last_step']}"
    rows.append(("steps", steps))
    if info.get("tokens") is not None:
        rows.append(("tokens", f"{info['tokens']:,} ({_human(info['tokens'])})"))
    rows.append(("wall time", format_duration(info["wall_time_s"]) if info.get("wall_time_s") is not None else None))
    rows.append(("tokens/s", f"{info['tokens_per_s']:,.0f} (mean)" if info.get("tokens_per_s") else None))
    pe = info.get("padding_efficiency")
    rows.append(("padding eff", f"{pe:.3f}" if pe is not None else None))
    rows.append(("train loss", f"{info['final_loss']:.4f} (final)" if info.get("final_loss") is not None else None))
    if info.get("peak_memory_bytes"):
        rows.append(
            ("peak memory", f"{info['peak_memory_bytes'] / 2**20:,.1f} MiB (worst step: {info['peak_memory_step']})")
        )
    if info.get("final_valid_loss") is not None:
        best = ""
        if info.get("best_valid_loss") is not None:
            best = f", best {info['best_valid_loss']:.4f}"
            if info.get("best_valid_step") is not None:
                best += f" at step {info['best_valid_step']}"
        rows.append(("valid loss", f"{info['final_valid_loss']:.4f} (final){best}"))
    rows.append(("checkpoint", info.get("checkpoint")))
    best = info.get("best_checkpoint")
    if best:  # checkpoint.keep_best
        rows.append(("best", f"{best['path']} (valid loss {best['valid_loss']:.4f}, step {best['step']})"))
    rows.append(("run dir", info.get("run_dir")))
    return _block(f"run {info.get('status', 'finished')}", rows)
