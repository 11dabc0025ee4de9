"""Sequence-length sets for simulations and benchmarks: seeded synthetic shapes and the embedded
data set's real lengths (which is why this lives beside the benchmarks, not in the pure planner)."""

from __future__ import annotations

import math
import os
import random

from backend.data.embedded import stdlib_source_files

LENGTH_SETS = ("rl_longtail", "sft_lognormal", "uniform", "equal", "short", "embedded")


def synthetic_lengths(name: str, count: int, *, seed: int = 0, cap: int = 8192) -> list[int]:
    """``count`` lengths of the named shape, at most ``cap`` tokens.

    rl_longtail: RL rollouts, prompt plus a heavy-tailed response, 15% of responses cut at the
      generation cap. sft_lognormal: log-normal SFT conversations (median about cap/16).
    uniform: uniform in [1, cap]. embedded: the standard library's source files (the embedded
      data set), byte-level. equal: every sequence cap/4 tokens. short: mean about cap/40,
      cap/16 at most (a chat/SFT set of short turns).
    """
    rng = random.Random(f"{name}:{seed}")
    if name == "rl_longtail":
        out = []
        for _ in range(count):
            prompt = rng.randint(cap // 64 + 1, cap // 8)
            if rng.random() < 0.15:
                out.append(cap)
            else:
                response = int(rng.paretovariate(1.2) * cap / 24)
                out.append(min(cap, prompt + response))
        return out
    if name == "sft_lognormal":
        mu = math.log(cap / 16)
        return [max(1, min(cap, int(rng.lognormvariate(mu, 0.9)))) for _ in range(count)]
    if name == "uniform":
        return [rng.randint(1, cap) for _ in range(count)]
    if name == "equal":
        return [max(1, cap // 4)] * count
    if name == "short":
        mean = max(2.0, cap / 40)
        return [max(1, min(cap // 16, int(rng.expovariate(1.0 / mean)) + 1)) for _ in range(count)]
    if name == "embedded":
        # Byte-level token counts of the standard library's source files, cut at the cap, drawn
        # with replacement: the lengths of the embedded default data set.
        sizes = [min(cap, max(1, os.path.getsize(f))) for f in stdlib_source_files()]
        return [rng.choice(sizes) for _ in range(count)]
    raise ValueError(f"unknown length set {name!r}; choose one of {', '.join(LENGTH_SETS)}")


def read_lengths_file(path: str) -> list[int]:
    """One positive integer a line; blank lines and # comments are skipped. Errors name file:line."""
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            text = line.split("#", 1)[0].strip()
            if not text:
                continue
            try:
                value = int(text)
            except ValueError:
                raise SystemExit(f"{path}:{lineno}: expected one integer length, got {text!r}") from None
            if value < 1:
                raise SystemExit(f"{path}:{lineno}: a sequence length must be >= 1, got {value}")
            out.append(value)
    if not out:
        raise SystemExit(f"{path}: no lengths found")
    return out
