#!/usr/bin/env python3
"""Draw one optimizer step's plan as a PNG: data-parallel ranks as rows, microbatch slots in order.

Every rank runs slot j at the same time (FSDP's collectives keep them in step), so slot j is as
wide as the slowest rank's microbatch in it (its cost: tokens one GPU holds, padding included,
after the CP cut). In each rank's row a microbatch is a box as wide as its cost: the dark part
is real tokens, the light part padding, and the hatched rest of the slot is time that rank
waits for the slowest one. Oversize singletons (one sequence over the budget) have a red
border; empty microbatches (a rank short of sequences) are marked "empty". The title carries
the plan's padding efficiency, rank imbalance and modelled step time.

From a config, with the windows the trainer would draw (data set, sampler, planner):

    python tools/plot/plot_plan.py configs/quickstart.yaml --dp 4 --cp 1 --step 3 --out plan.png
    python tools/plot/plot_plan.py configs/quickstart.yaml train.max_tokens_per_gpu=4096 --dp 2 --out plan.png

From a file of lengths (one integer a line; the whole file is the window, or the --step-th
window of --global-batch-size lengths):

    python tools/plot/plot_plan.py --lengths-file lengths.txt --dp 8 --cp 2 --max-tokens-per-gpu 16384 --out plan.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib  # noqa: E402

matplotlib.use("Agg")  # files only, no display

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

from backend.batching import DEFAULT_MICROBATCH_OVERHEAD, PlanArgs, StepPlan, plan  # noqa: E402
from backend.bench.length_sets import read_lengths_file  # noqa: E402
from backend.logging.figures import save_png  # noqa: E402

DPI = 100
WIDTH_IN = 14.0
REAL, PAD, IDLE, OVERSIZE = "#2b6cb0", "#a3c4e8", "#d9d9d9", "#d62728"


def figure_size(dp_size: int) -> tuple[float, float]:
    """Inches: 14 wide, 0.55 per rank plus room for the title, axis and legend (pixels = x 100)."""
    return WIDTH_IN, round(2.2 + 0.55 * max(1, dp_size), 2)


def plan_from_config(config: str, overrides: list[str], *, dp: int, cp: int | None, step: int) -> tuple[StepPlan, str]:
    """The plan of optimizer step ``step`` (1-based) as the trainer would make it: same data set,
    sampler stream and planner (bucket edges included). Returns (plan, a description)."""
    from backend.config import load_config, validate
    from backend.data.build import build_dataset
    from backend.data.iterator import bucket_edges_for, planner_from_config
    from backend.data.sampler import WindowSampler
    from backend.distributed.parallel_dims import ParallelDims

    cfg = load_config(config, overrides)
    if cp is not None:
        cfg.parallel.context_parallel_size = cp
    cp = cfg.parallel.context_parallel_size
    validate(cfg, world_size=dp * cp)
    dataset, _ = build_dataset(cfg.data)
    sampler = WindowSampler(len(dataset), cfg.train.global_batch_size, cfg.train.seed)
    for _ in range(step - 1):
        sampler.next_window()
    window = sampler.next_window()
    edges = bucket_edges_for(cfg.train, dataset.lengths, cp_size=cp)
    planner = planner_from_config(cfg.train, ParallelDims(world_size=dp * cp, cp=cp), bucket_edges=edges)
    step_plan = planner([int(n) for n in dataset.lengths[window]])
    return step_plan, f"{Path(config).name}, {dataset.source}, step {step}"


def plan_from_lengths(lengths: list[int], args: argparse.Namespace) -> tuple[StepPlan, str]:
    what = f"{Path(args.lengths_file).name}"
    if args.global_batch_size:
        start = (args.step - 1) * args.global_batch_size
        window = lengths[start : start + args.global_batch_size]
        if not window:
            raise SystemExit(f"{args.lengths_file}: no window {args.step} of {args.global_batch_size} lengths")
        what += f", step {args.step}"
    else:
        window = lengths
    plan_args = PlanArgs(
        dp_size=args.dp,
        cp_size=args.cp,
        max_tokens_per_gpu=args.max_tokens_per_gpu,
        micro_batch_size=args.micro_batch_size or 1,
        pad_to_multiple=args.pad_to_multiple,
        overhead=args.overhead,
        layout=args.layout,
    )
    return plan("fixed" if args.micro_batch_size else "dynamic", window, plan_args), what


def plural(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"


def mb_label(mb) -> str:
    """Padded: ``4x1024`` (rows x padded length); packed: ``9 seq / 4427`` (sequences in one row of that length)."""
    return f"{len(mb.indices)} seq / {mb.padded_len}" if mb.packed else f"{len(mb.indices)}x{mb.padded_len}"


def draw_plan(step_plan: StepPlan, out: str | Path, *, title: str = "") -> Path:
    """Write ``step_plan`` as a PNG at ``out`` (size: ``figure_size(dp) * 100`` pixels)."""
    dp, n, cp = step_plan.dp_size, step_plan.num_microbatches, step_plan.cp_size
    widths = step_plan.slot_costs()
    starts = [sum(widths[:j]) for j in range(n)]
    total = max(1, sum(widths))
    fig, ax = plt.subplots(figsize=figure_size(dp), dpi=DPI)
    budget = step_plan.max_tokens_per_gpu
    oversize = 0
    for r, rank in enumerate(step_plan.ranks):
        y = r - 0.38
        for j, mb in enumerate(rank):
            x0 = starts[j]
            if widths[j]:
                ax.add_patch(Rectangle((x0, y), widths[j], 0.76, facecolor=IDLE, edgecolor="none", hatch="///"))
            if mb.is_empty:
                ax.plot([x0 + total * 0.004], [r], marker="x", color="black", markersize=7, clip_on=False)
                ax.text(
                    x0 + total * 0.01,
                    r,
                    "empty microbatch",
                    ha="left",
                    va="center",
                    fontsize=7,
                    bbox={"facecolor": "white", "edgecolor": "none", "pad": 1.0},
                )
                continue
            real = mb.tokens / cp
            single_over = budget is not None and len(mb.indices) == 1 and mb.cost > budget
            oversize += single_over
            ax.add_patch(Rectangle((x0, y), mb.cost, 0.76, facecolor=PAD, edgecolor="white", linewidth=0.6))
            ax.add_patch(Rectangle((x0, y), real, 0.76, facecolor=REAL, edgecolor="none"))
            if single_over:
                ax.add_patch(Rectangle((x0, y), mb.cost, 0.76, fill=False, edgecolor=OVERSIZE, linewidth=2.0))
            if mb.cost > total * 0.045:  # room for a label: rows x padded length
                ax.text(
                    x0 + mb.cost / 2,
                    r,
                    mb_label(mb),
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white",
                )
    for x in starts[1:]:
        ax.axvline(x, color="black", linewidth=0.5, alpha=0.35)
    ax.set_xlim(0, total)
    ax.set_ylim(dp - 0.5, -0.5)
    ax.set_yticks(range(dp), [f"dp {r}" for r in range(dp)])
    ax.set_ylabel("data-parallel rank")
    ax.set_xlabel(
        f"tokens per GPU (padded, after the CP cut), microbatch slots in execution order: {plural(n, 'slot')}, "
        f"{total:,} tokens on the slowest path"
    )
    if n <= 40:  # slot numbers on a secondary axis at the top
        top = ax.secondary_xaxis("top")
        top.set_xticks([s + w / 2 for s, w in zip(starts, widths)], [str(j) for j in range(n)], fontsize=7)
        top.set_xlabel("microbatch slot", fontsize=8)
    m = step_plan.metrics()
    head = (
        f"{step_plan.kind} plan"
        + (f", budget {budget:,} tokens/GPU" if budget else "")
        + f", dp {dp} x cp {cp}, {m['num_sequences']} sequences"
    )
    stats = (
        f"padding efficiency {m['padding_efficiency']:.3f} (worst rank {m['padding_efficiency_min_rank']:.3f}) | "
        f"rank imbalance {m['rank_imbalance']:.3f} | modelled step {m['modelled_step_time']:,} tokens "
        f"(+{step_plan.overhead:,}/microbatch) | "
        f"{m['distinct_shapes']} shapes | {oversize} oversize | {m['empty_microbatches']} empty"
    )
    ax.set_title(f"{title + ': ' if title else ''}{head}\n{stats}", fontsize=10)
    legend = [
        Patch(facecolor=REAL, label="real tokens"),
        Patch(facecolor=PAD, label="padding"),
        Patch(facecolor=IDLE, hatch="///", label="waiting for the slowest rank"),
        Patch(facecolor="white", edgecolor=OVERSIZE, linewidth=2.0, label="oversize singleton"),
        Line2D([], [], marker="x", color="black", linestyle="none", label="empty microbatch"),
    ]
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:,.0f}"))
    fig.legend(handles=legend, loc="lower center", ncol=5, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.4 / fig.get_figheight(), 1, 1))
    return save_png(fig, out, DPI)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", help="a training config (YAML)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, as for python -m backend.train")
    p.add_argument("--lengths-file", help="one sequence length a line, instead of a config")
    p.add_argument("--dp", type=int, default=1, help="data-parallel ranks")
    p.add_argument(
        "--cp", type=int, default=None, help="context-parallel size (config: parallel.context_parallel_size)"
    )
    p.add_argument("--step", type=int, default=1, help="which optimizer step's window (1-based)")
    p.add_argument("--max-tokens-per-gpu", type=int, default=16384, help="lengths file: the budget")
    p.add_argument("--pad-to-multiple", type=int, default=1, help="lengths file: pad lengths to this multiple")
    p.add_argument("--overhead", type=int, default=DEFAULT_MICROBATCH_OVERHEAD, help="lengths file: per microbatch")
    p.add_argument("--micro-batch-size", type=int, default=0, help="lengths file: a fixed plan of this size instead")
    p.add_argument("--global-batch-size", type=int, default=0, help="lengths file: window size (0: the whole file)")
    p.add_argument("--layout", default="padded", choices=("padded", "packed"), help="lengths file: the layout")
    p.add_argument("--out", default="plan.png", help="the PNG to write")
    args = p.parse_args(argv)
    if (args.config is None) == (args.lengths_file is None):
        p.error("give a config or --lengths-file (one of them)")
    if args.dp < 1 or args.step < 1 or (args.cp is not None and args.cp < 1):
        p.error("--dp, --cp and --step must be >= 1")
    if args.lengths_file:
        args.cp = args.cp or 1
        step_plan, what = plan_from_lengths(read_lengths_file(args.lengths_file), args)
    else:
        from backend.config import ConfigError
        from backend.data.errors import DataError

        try:
            step_plan, what = plan_from_config(args.config, args.overrides, dp=args.dp, cp=args.cp, step=args.step)
        except (ConfigError, DataError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    out = draw_plan(step_plan, args.out, title=what)
    m = step_plan.metrics()
    print(
        f"wrote {out}: {plural(step_plan.num_microbatches, 'microbatch', 'microbatches')} x "
        f"{plural(step_plan.dp_size, 'rank')}, padding efficiency "
        f"{m['padding_efficiency']:.3f}, rank imbalance {m['rank_imbalance']:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
