"""The PPO / GRPO policy objective per loss token, and its normalisation over the optimizer window.

Per loss token t (DESIGN.md 4b), with lp the policy's log-probability of token t, old the
sampler's (or recomputed) one, ref the reference model's, A the advantage, c the dual clip:

    r   = exp(clamp(lp - old, -logratio_clamp, +logratio_clamp))
    pg  = max(-A r, -A clip(r, 1 - ratio_clip_low, 1 + ratio_clip_high));  where A < 0 and c > 1: min(pg, -c A)
    KL  = k1: lp - ref | k2: (lp - ref)^2 / 2 | k3: exp(ref - lp) - (ref - lp) - 1  (ref - lp clamped likewise)
    l_t = loss_weight_t * (pg + kl_coef KL - entropy_coef H)

The window's objective is sum_t scale_t l_t over every loss token of every rank and microbatch,
with scale_t = 1 / (the window's loss tokens) (``token``) or 1 / (the token's sequence's loss
tokens x the window's sequences that have any) (``sequence``). Both denominators come from the
dataset index, so no plan changes the objective or its gradient: the field's recurring bug (verl
#5625 / #6957 / #7225, OpenRLHF #1078, NeMo-RL #2839, Megatron-LM #3078) is a per-microbatch mean.

Values at masked positions never reach the loss: the inputs are replaced (``where``, not a
product) before any arithmetic, so a NaN there changes neither the loss nor the gradient.
"""

from __future__ import annotations

import torch

from backend.distributed.collectives import dist_max_tensor, dist_sum

from .outputs import microbatch_logprobs, sequence_sum
from .registry import Objective, register_loss
from .rollout import correction_weights, mismatch_terms

# Window metrics summed with the loss's scale (pg_loss, kl, entropy weighted by loss_weight, so
# objective = pg_loss + kl_coef kl - entropy_coef entropy; clipfrac, clipfrac_lower and approx_kl
# per loss token; the sampler mismatch measures per loss token, when rows carry rollout_logprobs).
MISMATCH = ("token_mult_prob_error", "rollout_logprob_abs_diff", "rollout_kl", "rollout_correction_share")
SUMMED = ("pg_loss", "kl", "entropy", "clipfrac", "clipfrac_lower", "approx_kl", *MISMATCH)


def kl_penalty(
    lp: torch.Tensor, ref: torch.Tensor, estimator: str, clamp: float, out_clamp: float = 0.0
) -> torch.Tensor:
    """Schulman's estimators of KL(policy || reference) at the sampled token; ``out_clamp`` > 0
    clamps the value to +-out_clamp (``loss.kl_clamp``: verl's low_var_kl clamps k3 at 10)."""
    if estimator == "k1":
        kl = lp - ref
    elif estimator == "k2":
        kl = (lp - ref).square() / 2
    elif estimator == "k3":
        x = (ref - lp).clamp(-clamp, clamp)
        kl = torch.exp(x) - x - 1
    else:
        raise ValueError(f"loss.kl_estimator={estimator!r}: allowed values are k1, k2, k3")
    return kl.clamp(-out_clamp, out_clamp) if out_clamp else kl


def policy_token_terms(
    lp: torch.Tensor,
    entropy: torch.Tensor | None,
    *,
    loss_mask: torch.Tensor,
    loss_weight: torch.Tensor,
    advantages: torch.Tensor | None,
    old_logprobs: torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
    cfg,
    rollout_logprobs: torch.Tensor | None = None,
    sequence_sum=None,
) -> dict[str, torch.Tensor]:
    """Per-position terms [rows, s] of the objective (``cfg`` is the ``loss`` config section).

    Returns ``objective`` (l_t above, 0 off the loss tokens) and, per position, ``pg``, ``kl``,
    ``entropy`` (each times loss_weight, as in the objective), ``clipped`` (1 where the clipped
    term is the larger: no gradient flows there), ``clipped_lower`` (1 where the dual clip bounds
    a negative-advantage token: verl's pg_clipfrac_lower), ``approx_kl`` (old - lp), ``ratio`` and
    ``used``; with ``rollout_logprobs`` (the sampler's) also the mismatch measures and, under
    ``loss.rollout_correction``, the detached correction weight on pg (``backend/loss/rollout.py``;
    ``sequence_sum`` sums a per-token value over each token's sequence, for the sequence-level
    corrections). Missing fields (a placeholder microbatch) count as zero advantage and
    old = ref = rollout = lp.
    """
    used = loss_mask > 0
    lp_d = lp.detach()
    zeros = torch.zeros_like(lp_d)
    adv = zeros if advantages is None else torch.where(used, advantages.to(lp.dtype), zeros)
    # Rows without the sampler's log-probabilities (NaN in a mixed microbatch) are left out of the
    # mismatch measures and never corrected.
    has_rollout = None if rollout_logprobs is None else used & torch.isfinite(rollout_logprobs)
    rollout = None if rollout_logprobs is None else torch.where(has_rollout, rollout_logprobs.to(lp.dtype), lp_d)
    if cfg.old_logprobs == "rollout" and rollout is not None:
        old = rollout
    elif cfg.old_logprobs in ("detach", "rollout") or old_logprobs is None:
        old = lp_d
    else:
        old = torch.where(used, old_logprobs.to(lp.dtype), lp_d)
    ratio = torch.exp((lp - old).clamp(-cfg.logratio_clamp, cfg.logratio_clamp))
    unclipped = -adv * ratio
    clipped_term = -adv * ratio.clamp(1 - cfg.ratio_clip_low, 1 + cfg.ratio_clip_high)
    pg = torch.maximum(unclipped, clipped_term)
    clipped = (clipped_term > unclipped) & used
    clipped_lower = torch.zeros_like(used)
    if cfg.dual_clip:
        bound = -cfg.dual_clip * adv
        clipped_lower = (adv < 0) & (pg > bound) & used
        pg = torch.where(adv < 0, torch.minimum(pg, bound), pg)
    terms: dict[str, torch.Tensor] = {}
    method = getattr(cfg, "rollout_correction", "none")
    if rollout is not None:
        terms.update(mismatch_terms(lp_d, rollout, has_rollout), rollout_used=has_rollout)
        if method != "none":
            w, changed = correction_weights(
                old.detach() - rollout,
                has_rollout,
                method=method,
                cap=cfg.rollout_correction_cap,
                floor=cfg.rollout_correction_floor,
                sequence_sum=sequence_sum,
            )
            pg = pg * w
            terms["rollout_correction_share"] = changed.to(lp.dtype)
        else:
            terms["rollout_correction_share"] = zeros
    weight = torch.where(used, loss_weight.to(lp.dtype), zeros)
    terms["pg"] = weight * pg
    objective = terms["pg"]
    if ref_logprobs is not None:
        ref = torch.where(used, ref_logprobs.to(lp.dtype), lp_d)
        terms["kl"] = weight * kl_penalty(lp, ref, cfg.kl_estimator, cfg.logratio_clamp, getattr(cfg, "kl_clamp", 0.0))
        if cfg.kl_coef:
            objective = objective + cfg.kl_coef * terms["kl"]
    if entropy is not None:
        terms["entropy"] = weight * torch.where(used, entropy, zeros)
        if cfg.entropy_coef:
            objective = objective - cfg.entropy_coef * terms["entropy"]
    terms.update(
        objective=objective,
        clipped=clipped.to(lp.dtype),
        clipped_lower=clipped_lower.to(lp.dtype),
        approx_kl=torch.where(used, old - lp_d, zeros),
        ratio=ratio.detach(),
        used=used,
    )
    return terms


def token_scale(
    loss_mask: torch.Tensor,
    sequence_targets: torch.Tensor | None,
    *,
    normalization: str,
    window_tokens: int,
    window_sequences: int,
) -> torch.Tensor:
    """Each position's share of the window objective: 1 / N_tokens, or 1 / (n_seq x N_sequences)."""
    used = loss_mask > 0
    zeros = torch.zeros_like(loss_mask, dtype=torch.float32)
    if sequence_targets is None:  # a placeholder microbatch: no loss tokens
        return zeros
    if normalization == "token":
        return torch.where(used, zeros + 1.0 / max(1, window_tokens), zeros)
    if normalization == "sequence":
        per_seq = sequence_targets.float().clamp_min(1) * max(1, window_sequences)
        return torch.where(used, 1.0 / per_seq, zeros)
    raise ValueError(f"loss.normalization={normalization!r}: allowed values are token, sequence")


class WindowStats:
    """The window's metrics accumulated microbatch by microbatch (local sums, min, max), then
    reduced over every rank: sums by sum, ratio_min / ratio_max / rollout_logprob_abs_diff_max by
    min / max, so none depends on the plan. Empty and placeholder microbatches add exactly zero
    (their scale is 0). The mismatch measures are reported when any rank's rows carried
    ``rollout_logprobs``."""

    def __init__(self, device, group):
        self.group = group  # the ranks holding distinct tokens (ParallelDims' "loss")
        keys = ("objective", *SUMMED, "rollout_tokens")
        self.sums = {k: torch.zeros((), dtype=torch.float64, device=device) for k in keys}
        self.low = torch.full((), float("inf"), dtype=torch.float64, device=device)
        self.high = torch.full((), float("-inf"), dtype=torch.float64, device=device)
        self.gap = torch.zeros((), dtype=torch.float64, device=device)

    def add(self, terms: dict[str, torch.Tensor], scale: torch.Tensor) -> None:
        with torch.no_grad():
            s = scale.double()
            self.sums["objective"] += (terms["objective"].detach().double() * s).sum()
            self.sums["pg_loss"] += (terms["pg"].detach().double() * s).sum()
            for key in ("kl", "entropy", *MISMATCH):
                if key in terms:
                    self.sums[key] += (terms[key].detach().double() * s).sum()
            self.sums["clipfrac"] += (terms["clipped"].double() * s).sum()
            self.sums["clipfrac_lower"] += (terms["clipped_lower"].double() * s).sum()
            self.sums["approx_kl"] += (terms["approx_kl"].double() * s).sum()
            # where, not indexing or a branch: no device-to-host sync per microbatch
            used, ratio = terms["used"], terms["ratio"].double()
            inf = torch.full_like(ratio, float("inf"))
            self.low = torch.minimum(self.low, torch.where(used, ratio, inf).min())
            self.high = torch.maximum(self.high, torch.where(used, ratio, -inf).max())
            if "rollout_used" in terms:  # the mismatch measures' own denominator: tokens with rollout_logprobs
                self.sums["rollout_tokens"] += (terms["rollout_used"].double() * s).sum()
                self.gap = torch.maximum(self.gap, terms["rollout_logprob_abs_diff"].double().max())

    def reduce(self, *, kl: bool, entropy: bool) -> dict[str, float]:
        """Every rank's totals: ``loss`` (the objective) and the metrics (kl / entropy when measured)."""
        keys = list(self.sums)
        packed = dist_sum(torch.stack([self.sums[k] for k in keys]), self.group)
        extremes = dist_max_tensor(torch.stack([-self.low, self.high, self.gap]), self.group)
        out = {("loss" if k == "objective" else k): float(v) for k, v in zip(keys, packed.tolist())}
        if not kl:
            out.pop("kl")
        if not entropy:
            out.pop("entropy")
        out["ratio_min"], out["ratio_max"] = float(-extremes[0]), float(extremes[1])
        share = out.pop("rollout_tokens")  # 1 (to rounding) when every loss token has the sampler's log-probability
        if share > 0:
            for key in MISMATCH:
                out[key] /= share
            out["rollout_logprob_abs_diff_max"] = float(extremes[2])
        else:
            for key in MISMATCH:
                out.pop(key)
        return out


def window_objective(terms: dict, mb, data, loss_cfg, stats) -> torch.Tensor:
    """A microbatch's share of the window objective from its per-token terms (policy and value
    losses alike), its metrics added to ``stats`` with the same per-position shares: the window's
    loss tokens, or its sequences, never the microbatch's (``loss.normalization``)."""
    scale = token_scale(
        mb.loss_mask,
        mb.sequence_targets,
        normalization=loss_cfg.normalization,
        window_tokens=data.global_loss_tokens,
        window_sequences=data.global_loss_sequences,
    )
    stats.add(terms, scale)
    return (terms["objective"] * scale).sum()


@register_loss("policy")
class Policy(Objective):
    """The PPO / GRPO objective (``policy_token_terms``), normalised over the window; metrics
    pg_loss, kl (when kl_coef > 0), entropy, clipfrac, approx_kl, ratio_min, ratio_max and the
    sampler mismatch measures."""

    def begin(self, data, env) -> None:
        self.stats = WindowStats(env.device, env.group("loss"))

    def microbatch(self, model, mb, data, env):
        cfg = self.cfg
        mb = mb.to(env.device)
        # The entropy is always measured (a metric); it joins the graph only when it is in the loss.
        entropy = "grad" if cfg.entropy_coef else "value"
        lp, h = microbatch_logprobs(
            model, mb, env.cp_group, entropy=entropy, route_rows=mb.sample_ids >= 0, temperature=cfg.temperature
        )
        terms = policy_token_terms(
            lp,
            h,
            loss_mask=mb.loss_mask,
            loss_weight=mb.loss_weight,
            advantages=mb.advantages,
            old_logprobs=mb.old_logprobs,
            ref_logprobs=mb.ref_logprobs,
            cfg=cfg,
            rollout_logprobs=mb.rollout_logprobs,
            sequence_sum=sequence_sum(mb, env.cp_group if env.cp_size > 1 else None),
        )
        return window_objective(terms, mb, data, cfg, self.stats)

    def end(self, env) -> dict[str, float]:
        return self.stats.reduce(kl=bool(self.cfg.kl_coef), entropy=True)
