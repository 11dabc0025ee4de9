"""Synthetic policy-gradient rows (rollouts) for tests, compare_arms and the GPU check: prompt +
response token ids, a loss mask on the response, a per-sample advantage and sampler / reference
log-probabilities near a random model's (about -log of its padded vocabulary, 384 for the byte
tokenizer), so some ratios clip and the KL is not zero. No sampler is involved: the numbers only
have to be plausible, since what is checked is that every plan trains them the same way.

    python -m backend.bench.rl_rows --out rollouts.jsonl --count 64 --max-len 1024
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np


def rl_rows(
    count: int = 16,
    *,
    seed: int = 0,
    min_len: int = 12,
    max_len: int = 120,
    nan_masked: bool = True,
    vocab: int = 256,
    padded_vocab: int = 384,
    rollout: bool = False,
) -> list[dict]:
    """``count`` rows of uneven lengths; masked (prompt) entries are null when ``nan_masked``;
    with ``rollout`` also the sampler's ``rollout_logprobs`` (the old ones plus noise of 0.3, so
    the corrections clamp and mask some tokens)."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(count):
        n = int(rng.integers(min_len, max_len + 1))
        prompt = int(rng.integers(2, max(3, n // 3)))
        mask = [0] * prompt + [1] * (n - prompt)
        base = -math.log(padded_vocab)
        old = (base + rng.normal(0, 0.4, n)).tolist()
        ref = (base + rng.normal(0, 0.4, n)).tolist()
        if nan_masked:
            old = [None if m == 0 else v for v, m in zip(old, mask)]
            ref = [None if m == 0 else v for v, m in zip(ref, mask)]
        row = {
            "id": f"rollout-{i}",
            "input_ids": rng.integers(0, vocab, n).tolist(),
            "loss_mask": mask,
            "advantages": float(rng.normal()),
            "old_logprobs": old,
            "ref_logprobs": ref,
        }
        if rollout:
            shift = rng.normal(0, 0.3, n)
            row["rollout_logprobs"] = [None if v is None else v + float(e) for v, e in zip(old, shift)]
        rows.append(row)
    return rows


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--count", type=int, default=64)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    write_rows(Path(args.out), rl_rows(args.count, seed=args.seed, max_len=args.max_len))
    print(f"wrote {args.count} rollouts (up to {args.max_len} tokens) to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
