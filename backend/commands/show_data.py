#!/usr/bin/env python3
"""Show rows as the trainer sees them: which tokens a row trains on, before any GPU hour is spent.

    python tools/show_data.py configs/quickstart.yaml --rows 3
    python tools/show_data.py configs/qwen3_4b_grpo.yaml data.path=rl.jsonl --index 7
    python tools/show_data.py CONFIG --plan --dp 8

Reads only the data and the tokenizer (no model, no GPU), through the trainer's own data path:
tokenisation, the chat template (one sample per assistant turn where the template rewrites
earlier turns), truncation or dropping of overlong rows, the end-of-document id, the held-out
validation split. Each row shows its text with the trained tokens marked (green on a terminal;
``[[`` ... ``]]`` around them when piped) and its counts. ``--index I`` adds every token of sample I
with its id and per-token fields (loss mask, loss weight, advantages, old / reference
log-probabilities when present); ``--plan`` the first window's microbatch plan per DP rank.
"""

from __future__ import annotations

import argparse
import functools
import sys

OPEN, CLOSE = "[[", "]]"


def load(config: str, overrides: list[str], dp: int):
    from backend.config import load_config, validate
    from backend.data.build import build_dataset
    from backend.data.row_fields import row_fields
    from backend.data.split import build_train_and_valid

    cfg = load_config(config, overrides)
    cfg = validate(cfg, dp * cfg.parallel.context_parallel_size)
    build = functools.partial(build_dataset, fields=row_fields(cfg.loss, lora=cfg.model.lora.rank > 0))
    dataset, _, tokenizer = build_train_and_valid(cfg.data, cfg.train.seed, build=build)
    return cfg, dataset, tokenizer


def trained(sample) -> list[bool]:
    """Which tokens are loss targets: a mask of 1 and a non-zero weight, never the first token
    (it is predicted from nothing; ``Sample.loss_tokens`` counts the same)."""
    n = len(sample.tokens)
    mask = sample.loss_mask if sample.loss_mask is not None else [1] * n
    weight = sample.loss_weight if sample.loss_weight is not None else [1.0] * n
    return [i > 0 and bool(m) and float(w) != 0.0 for i, (m, w) in enumerate(zip(mask, weight))]


def visible(text: str) -> str:
    """Control characters (other than newline and tab) as escapes, so they cannot act on a terminal."""
    return "".join(c if c.isprintable() or c in "\n\t" else repr(c)[1:-1] for c in text)


def spans(tokenizer, sample) -> list[tuple[str, bool]]:
    """The sample's text in runs of (text, trained)."""
    out: list[tuple[str, bool]] = []
    ids = [int(t) for t in sample.tokens]
    flags = trained(sample)
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or flags[i] != flags[start]:
            out.append((visible(tokenizer.decode(ids[start:i], specials=True)), flags[start]))
            start = i
    return out


def row_text(tokenizer, sample, color: bool):
    """A rich ``Text`` (trained green, the rest dim) on a terminal; plain text with markers piped."""
    from rich.text import Text

    if not color:
        return "".join(
            f"{OPEN}{piece}{CLOSE}" if is_trained else piece for piece, is_trained in spans(tokenizer, sample)
        )
    text = Text()
    for piece, is_trained in spans(tokenizer, sample):
        text.append(piece, style="bold green" if is_trained else "dim")
    return text


def token_rows(tokenizer, sample) -> tuple[list[str], list[list[str]]]:
    fields = [
        name
        for name in ("loss_mask", "loss_weight", "advantages", "old_logprobs", "ref_logprobs")
        if getattr(sample, name) is not None
    ]
    rows = []
    for i, token in enumerate(sample.tokens):
        values = []
        for name in fields:
            v = getattr(sample, name)[i]
            values.append(str(int(v)) if name == "loss_mask" else f"{float(v):.4g}")
        rows.append([str(i), str(int(token)), repr(tokenizer.decode([int(token)], specials=True)), *values])
    return ["pos", "id", "piece", *fields], rows


def plan_lines(cfg, dataset, dp: int) -> list[str]:
    from backend.data.iterator import bucket_edges_for, planner_from_config
    from backend.data.sampler import WindowSampler
    from backend.distributed.parallel_dims import ParallelDims

    cp, tp = cfg.parallel.context_parallel_size, cfg.parallel.tensor_parallel_size
    window = WindowSampler(len(dataset), cfg.train.global_batch_size, cfg.train.seed).next_window()
    dims = ParallelDims(world_size=dp * cp * tp, cp=cp, tp=tp, sequence_parallel=cfg.parallel.sequence_parallel)
    edges = bucket_edges_for(cfg.train, dataset.lengths, cp_size=cp, sp_size=dims.sp)
    plan = planner_from_config(cfg.train, dims, bucket_edges=edges)([int(n) for n in dataset.lengths[window]])
    lines = [
        f"first window: {len(window)} samples, {plan.layout} layout, dp {dp}, cp {cp}, tp {tp}, "
        f"{len(plan.ranks[0])} microbatches per rank"
    ]
    for rank, microbatches in enumerate(plan.ranks):
        for j, mb in enumerate(microbatches):
            ids = [int(window[i]) for i in mb.indices]
            shape = f"1 row of {mb.padded_len}" if mb.packed else f"{len(ids)} x {mb.padded_len}"
            lines.append(f"  rank {rank} mb {j}: {shape} ({mb.tokens} tokens, cost {mb.cost}) samples {ids}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="a training config (YAML)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value, as for training")
    p.add_argument("--rows", type=int, default=3, help="how many samples to show from the start (default 3)")
    p.add_argument("--index", type=int, help="show this sample, with every token and its per-token fields")
    p.add_argument("--plan", action="store_true", help="the first window's microbatch plan per DP rank")
    p.add_argument("--dp", type=int, default=1, help="data-parallel size for --plan (default 1)")
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto")
    args = p.parse_intermixed_args(argv)

    from rich.console import Console
    from rich.table import Table

    from backend.errors import UserError

    console = Console(force_terminal={"always": True, "never": False}.get(args.color), highlight=False, soft_wrap=True)
    color = console.is_terminal
    say = console.print if color else print  # piped: the text exactly as it is (tabs, brackets)
    try:
        cfg, dataset, tokenizer = load(args.config, args.overrides, args.dp)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    say(
        f"{dataset.source}: {len(dataset):,} samples, {int(dataset.lengths.sum()):,} tokens, "
        f"{int(dataset.loss_token_counts.sum()):,} trained; data.max_seq_length={cfg.data.max_seq_length}, "
        f"data.overlong={cfg.data.overlong}; tokenizer {getattr(tokenizer, 'name', '?')}"
        + ("" if color else f"; trained tokens are between {OPEN} and {CLOSE}")
    )
    indices = [args.index] if args.index is not None else range(min(args.rows, len(dataset)))
    for i in indices:
        if not 0 <= i < len(dataset):
            print(f"error: --index {i}: the data set has samples 0..{len(dataset) - 1}", file=sys.stderr)
            return 2
        sample = dataset[i]
        flags = trained(sample)
        say(f"--- sample {i}: {len(sample.tokens)} tokens, {sum(flags)} trained")
        say(row_text(tokenizer, sample, color))
        if args.index is not None:
            header, rows = token_rows(tokenizer, sample)
            if color:
                table = Table(*header)
                for row in rows:
                    table.add_row(*row)
                console.print(table)
            else:
                print("\t".join(header))
                for row in rows:
                    print("\t".join(row))
    if args.plan:
        try:
            lines = plan_lines(cfg, dataset, args.dp)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        for line in lines:
            say(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
