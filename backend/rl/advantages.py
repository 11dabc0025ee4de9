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


def gae(
    token_rewards: np.ndarray, values: np.ndarray, mask: np.ndarray, *, gamma: float, lam: float
) -> tuple[np.ndarray, np.ndarray]:
    """Generalised advantage estimation (Schulman et al. 2016) over one response's tokens.

    ``token_rewards``, ``values`` and ``mask`` are per-token arrays of the same length (the
    response's loss positions, in order; ``mask`` 0 marks tokens inside a response that are not
    trained, e.g. a tool's output). Walking backwards over the trained tokens only:
    delta_t = r_t + gamma V_next - V_t, A_t = delta_t + gamma lam A_next, where "next" is the next
    trained token (V_next = 0 and A_next = 0 after the last); a masked token passes V_next and
    A_next through unchanged and its own reward is not used, as in verl's
    ``compute_gae_advantage_return`` (put a response's reward on a trained token: the loop puts it
    on the last one). Returns (advantages, returns = A + V); 0 at masked tokens.
    """
    r = np.asarray(token_rewards, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)
    m = np.asarray(mask, dtype=bool)
    if not (len(r) == len(v) == len(m)):
        raise ValueError(f"gae: rewards ({len(r)}), values ({len(v)}) and mask ({len(m)}) differ in length")
    adv = np.zeros_like(r)
    next_value = next_adv = 0.0
    for t in range(len(r) - 1, -1, -1):
        if not m[t]:
            continue
        delta = r[t] + gamma * next_value - v[t]
        next_adv = delta + gamma * lam * next_adv
        next_value = v[t]
        adv[t] = next_adv
    returns = np.where(m, adv + v, 0.0)
    return adv, returns
