#!/usr/bin/env python3
"""Plot one or more runs' metrics.jsonl as a PNG: loss (and valid_loss), lr, tokens/s, padding
efficiency, rank imbalance and step time over optimizer steps, runs overlaid and labelled by
their run directory. RL runs (``python -m backend.rl``) get the reward curve (mean, min-max
band), response length, the policy objective, equal-reward groups and the time split instead.

    python tools/plot_metrics.py runs/quickstart --out quickstart.png
    python tools/plot_metrics.py runs/b8k runs/b16k/metrics.jsonl --out compare.png

Each argument is a run directory (holding metrics.jsonl) or a metrics.jsonl file. Evaluation
rows (``{"event": "eval", "step", "valid_loss"}``, written by MetricsLogger.log_eval) are drawn
as markers on the loss panel, dashed, in the run's colour. A metric a run did not log is skipped.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib  # noqa: E402

matplotlib.use("Agg")  # files only, no display

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter, MaxNLocator  # noqa: E402

from backend.logging.figures import save_png  # noqa: E402
from backend.logging.metrics import read_metrics  # noqa: E402

DPI = 100
FIGSIZE = (15.0, 8.5)  # inches: 1500 x 850 pixels
# (metric key, panel title, y label); loss is drawn with valid_loss, padding efficiency with its worst rank.
PANELS = (
    ("loss", "training loss", "loss"),
    ("lr", "learning rate", "lr"),
    ("tokens_per_s", "throughput", "tokens / s"),
    ("padding_efficiency", "padding efficiency (solid: all ranks, dotted: worst rank)", "real / padded tokens"),
    ("rank_imbalance", "rank imbalance (slowest rank's cost / mean - 1)", "imbalance"),
    ("step_time_s", "step time", "seconds"),
)

# RL runs (rows with reward_mean, written by python -m backend.rl): the reward curve first.
RL_PANELS = (
    ("reward_mean", "reward (line: mean; band: min to max)", "reward"),
    ("response_length_mean", "response length (mean)", "tokens"),
    ("loss", "policy objective", "loss"),
    ("zero_variance_groups", "groups whose rewards are all equal", "share of groups"),
    ("generate_s", "generation time per step", "seconds"),
    ("step_time_s", "training step time", "seconds"),
)


def resolve(path: str) -> Path:
    p = Path(path)
    return p / "metrics.jsonl" if p.is_dir() else p


def run_labels(paths: list[Path]) -> list[str]:
    """The run directory's name, or more of its path where two runs share a name."""
    labels = [p.parent.name or str(p.parent) for p in paths]
    if len(set(labels)) < len(labels):
        labels = [str(p.parent) for p in paths]
    return labels


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), int | float)]
    return [s for s, _ in pts], [v for _, v in pts]


def plot_metrics(paths: list[Path], out: str | Path, *, title: str = "") -> Path:
    """Write the panels for the runs at ``paths`` (metrics.jsonl files) to ``out`` (1500 x 850 px)."""
    runs = []
    for path, label in zip(paths, run_labels(paths)):
        train, evals = read_metrics(path)
        if not train and not evals:
            raise SystemExit(f"{path}: no metrics rows")
        runs.append((label, train, evals))
    fig, axes = plt.subplots(2, 3, figsize=FIGSIZE, dpi=DPI, sharex=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    rl = any("reward_mean" in r for _, train, _ in runs for r in train)
    for ax, (key, panel_title, ylabel) in zip(axes.flat, RL_PANELS if rl else PANELS):
        drawn = False
        for i, (label, train, evals) in enumerate(runs):
            color = colors[i % len(colors)]
            steps, values = _series(train, key)
            if steps:
                ax.plot(steps, values, color=color, linewidth=1.3, label=label, marker="." if len(steps) < 40 else None)
                drawn = True
            if key == "loss":
                vsteps, vvalues = _series(evals, "valid_loss")
                if vsteps:
                    ax.plot(vsteps, vvalues, color=color, linestyle="--", marker="o", label=f"{label} (valid)")
                    drawn = True
            if key == "reward_mean":
                lsteps, low = _series(train, "reward_min")
                hsteps, high = _series(train, "reward_max")
                if lsteps and lsteps == hsteps:
                    ax.fill_between(lsteps, low, high, color=color, alpha=0.15, linewidth=0)
            if key == "padding_efficiency":
                wsteps, wvalues = _series(train, "padding_efficiency_min_rank")
                if wsteps:
                    ax.plot(wsteps, wvalues, color=color, linestyle=":", linewidth=1.0)
        if key == "loss" and any(evals for _, _, evals in runs):
            panel_title = "loss (train: line, valid: dashed with markers)"
        ax.set_title(panel_title, fontsize=10)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if key == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
        if key == "tokens_per_s":
            ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:,.0f}"))
        if not drawn:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
    for ax in axes[-1]:
        ax.set_xlabel("optimizer step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    handles, labels = axes.flat[0].get_legend_handles_labels()
    if not handles:
        handles, labels = axes.flat[2].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(6, max(1, len(labels))), fontsize=9, frameon=False)
    fig.suptitle(title or f"metrics: {', '.join(label for label, _, _ in runs)}", fontsize=12)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return save_png(fig, out, DPI)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run directories or metrics.jsonl files")
    p.add_argument(
        "--out", default="metrics.png", help="the PNG to write (default: metrics.png in the current directory)"
    )
    p.add_argument("--title", default="", help="figure title (default: the run labels)")
    args = p.parse_args(argv)
    paths = [resolve(r) for r in args.runs]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        print(f"error: no metrics.jsonl at {', '.join(missing)}", file=sys.stderr)
        return 1
    out = plot_metrics(paths, args.out, title=args.title)
    print(f"wrote {out}: {len(paths)} run(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
