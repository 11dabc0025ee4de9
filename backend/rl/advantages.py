"""Advantages from rewards (pure numpy).

GRPO (Shao et al. 2024, DeepSeekMath): a prompt's group of G responses shares a baseline, the
group's mean reward; with ``scale`` each centred reward is divided by the group's standard
deviation (population std, + 1e-6 so a group whose rewards are all equal gets 0, not NaN), as
verl's ``compute_grpo_outcome_advantage`` does by default; without it (Dr. GRPO, Liu et al.
2025) only centred. A group of equal rewards carries no signal: its share is reported every step.
"""

from __future__ import annotations

import numpy as np

EPS = 1e-6


def group_advantages(rewards: np.ndarray, *, scale: bool = True) -> np.ndarray:
    """``rewards`` [groups, G] -> advantages [groups, G] (one scalar per response)."""
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 2 or r.shape[1] < 1:
        raise ValueError(f"rewards must be [groups, samples per group], got shape {r.shape}")
    centred = r - r.mean(axis=1, keepdims=True)
    if not scale:
        return centred
    return centred / (r.std(axis=1, keepdims=True) + EPS)


def zero_variance_share(rewards: np.ndarray) -> float:
    """Share of groups whose rewards are all equal (no learning signal in GRPO)."""
    r = np.asarray(rewards, dtype=np.float64)
    return float(np.mean(np.ptp(r, axis=1) == 0)) if len(r) else 0.0
