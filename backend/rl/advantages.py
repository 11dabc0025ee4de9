"""Advantages from rewards (pure numpy), and the estimators ``rl.advantage`` names.

An estimator (``@register_advantage("name")``) takes a step's rows (every response of every
prompt, prompt-major), their rewards [prompts, samples] and the critic (or None), writes each
row's ``advantages`` and returns the critic's rows (or None) and its metrics. ``grpo`` needs no
critic, ``gae`` one; a new estimator is one class and one name (plus the name in ``rl.advantage``'s
allowed values).

GRPO (Shao et al. 2024, DeepSeekMath): a prompt's group of G responses shares a baseline, the
group's mean reward; with ``scale`` each centred reward is divided by the group's standard
deviation (population std, + 1e-6 so a group whose rewards are all equal gets 0, not NaN), as
verl's ``compute_grpo_outcome_advantage`` does by default; without it (Dr. GRPO, Liu et al.
2025) only centred. A group of equal rewards carries no signal: its share is reported every step.
"""

from __future__ import annotations

import numpy as np

from backend.loss.registry import registrar

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


ADVANTAGES: dict[str, type] = {}


#: Class decorator: ``rl.advantage: name`` builds this estimator (with the ``rl`` section).
register_advantage = registrar(ADVANTAGES, "advantage")


def build_advantage(rl):
    """The estimator ``rl.advantage`` names."""
    if rl.advantage not in ADVANTAGES:
        raise ValueError(f"rl.advantage={rl.advantage!r}: allowed values are {', '.join(sorted(ADVANTAGES))}")
    return ADVANTAGES[rl.advantage](rl)


@register_advantage("grpo")
class GroupAdvantage:
    """GRPO's group-normalised advantage, one scalar per response (``group_advantages``)."""

    needs_critic = False

    def __init__(self, rl):
        self.rl = rl

    def __call__(self, rows: list[dict], rewards: np.ndarray, critic=None) -> tuple[list[dict] | None, dict]:
        advantages = group_advantages(rewards, scale=self.rl.scale_rewards).reshape(-1)
        for row, a in zip(rows, advantages):
            row["advantages"] = float(a)
        return None, {}


@register_advantage("gae")
class GAEAdvantage:
    """PPO with a critic: each response's reward on its last token, the critic's values of the
    rows (before its update), GAE advantages per token (whitened over the step's response tokens
    with ``rl.whiten_advantages``) into the policy rows, returns and old values into the critic's."""

    needs_critic = True

    def __init__(self, rl):
        self.rl = rl

    def __call__(self, rows: list[dict], rewards: np.ndarray, critic=None) -> tuple[list[dict] | None, dict]:
        import time

        rl = self.rl
        start = time.perf_counter()
        values = critic.values(rows)
        per_row = []
        for row, reward, v in zip(rows, np.asarray(rewards).reshape(-1).tolist(), values):
            mask = np.asarray(row["loss_mask"], dtype=bool)
            positions = np.flatnonzero(mask)
            token_rewards = np.zeros(len(positions))
            token_rewards[-1] = reward
            adv, ret = gae(token_rewards, v[positions], np.ones(len(positions)), gamma=rl.gamma, lam=rl.lam)
            per_row.append((positions, adv, ret, v))
        flat = np.concatenate([adv for _, adv, _, _ in per_row])
        mean, std = (flat.mean(), flat.std()) if rl.whiten_advantages else (0.0, 1.0)
        critic_rows = []
        for row, (positions, adv, ret, v) in zip(rows, per_row):
            n = len(row["input_ids"])
            advantages, returns = np.full(n, np.nan), np.full(n, np.nan)
            advantages[positions] = (adv - mean) / (std + 1e-8) if rl.whiten_advantages else adv
            returns[positions] = ret
            row["advantages"] = advantages.tolist()
            critic_rows.append(
                {"input_ids": row["input_ids"], "loss_mask": row["loss_mask"], "returns": returns, "old_values": v}
            )
        return critic_rows, {"values_s": time.perf_counter() - start, "advantage_std": float(flat.std())}
