"""Policy-gradient rows for tests: prompt + response token ids (byte vocabulary), a loss mask on
the response, a per-sample advantage and sampler / reference log-probabilities near a random
model's (about -log 384), so some ratios clip and the KL is not zero."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np


def rl_rows(
    count: int = 16, *, seed: int = 0, min_len: int = 12, max_len: int = 120, nan_masked: bool = True
) -> list[dict]:
    """``count`` rows of uneven lengths; masked (prompt) entries are null when ``nan_masked``."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(count):
        n = int(rng.integers(min_len, max_len + 1))
        prompt = int(rng.integers(2, max(3, n // 3)))
        mask = [0] * prompt + [1] * (n - prompt)
        base = -math.log(384)
        old = (base + rng.normal(0, 0.4, n)).tolist()
        ref = (base + rng.normal(0, 0.4, n)).tolist()
        if nan_masked:
            old = [None if m == 0 else v for v, m in zip(old, mask)]
            ref = [None if m == 0 else v for v, m in zip(ref, mask)]
        rows.append(
            {
                "id": f"rollout-{i}",
                "input_ids": rng.integers(0, 256, n).tolist(),
                "loss_mask": mask,
                "advantages": float(rng.normal()),
                "old_logprobs": old,
                "ref_logprobs": ref,
            }
        )
    return rows


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
