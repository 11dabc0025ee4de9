"""PPO's value loss (``loss.type: value``), per loss token, and its window reduction.

Per loss token t, with V the critic's value at t (the state before token t is generated: the
head's output at position t - 1, aligned like ``old_logprobs``), R the return, V_old the value the
rollout recorded and c = ``loss.value_clip``:

    vf_t = 0.5 max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)      (c = 0: 0.5 (V - R)^2)

as verl's ``compute_value_loss`` and OpenRLHF's ``ValueLoss`` define it. The window's objective is
sum_t scale_t loss_weight_t vf_t with the policy loss's ``token_scale`` (token or sequence
normalisation over the whole optimizer window), so no plan changes it. Metrics, normalised the
same way: ``vf_loss`` (the objective), ``vf_clipfrac`` (tokens where the clipped term is the
larger), ``value_mean``, and ``explained_variance`` = 1 - Var(R - V) / Var(R) over the window's
loss tokens (1: the values explain the returns; 0: no better than their mean).
"""

from __future__ import annotations

import torch

from backend.distributed.collectives import dist_sum

from .outputs import microbatch_values
from .policy import window_objective
from .registry import Objective, register_loss

SUMMED = ("vf_loss", "vf_clipfrac", "value_mean", "return_mean", "return_sq", "error_mean", "error_sq")


def value_token_terms(
    values: torch.Tensor,
    *,
    loss_mask: torch.Tensor,
    loss_weight: torch.Tensor,
    returns: torch.Tensor | None,
    old_values: torch.Tensor | None,
    cfg,
) -> dict[str, torch.Tensor]:
    """Per-position terms [rows, s]: ``objective`` (loss_weight x vf, 0 off the loss tokens),
    ``clipped``, and the values and returns for the metrics. Missing fields (a placeholder
    microbatch) count as R = V_old = V."""
    used = loss_mask > 0
    v_d = values.detach()
    zeros = torch.zeros_like(v_d)
    ret = v_d if returns is None else torch.where(used, returns.to(values.dtype), v_d)
    old = v_d if old_values is None else torch.where(used, old_values.to(values.dtype), v_d)
    unclipped = (values - ret).square()
    c = cfg.value_clip
    if c:
        clipped_v = torch.clamp(values, old - c, old + c)  # exactly V inside the range (no old + (V - old) rounding)
        clipped_sq = (clipped_v - ret).square()
        vf = 0.5 * torch.maximum(unclipped, clipped_sq)
        clipped = (clipped_sq > unclipped) & used
    else:
        vf, clipped = 0.5 * unclipped, torch.zeros_like(used)
    weight = torch.where(used, loss_weight.to(values.dtype), zeros)
    return {
        "objective": weight * vf,
        "clipped": clipped.to(values.dtype),
        "values": torch.where(used, v_d, zeros),
        "returns": torch.where(used, ret, zeros),
        "used": used,
    }


class ValueStats:
    """The window's value metrics: local sums with the loss's scale, reduced over every rank."""

    def __init__(self, device, group):
        self.group = group  # the ranks holding distinct tokens (ParallelDims' "loss")
        self.sums = {k: torch.zeros((), dtype=torch.float64, device=device) for k in SUMMED}

    def add(self, terms: dict[str, torch.Tensor], scale: torch.Tensor) -> None:
        with torch.no_grad():
            s = scale.double()
            v, r = terms["values"].double(), terms["returns"].double()
            err = r - v
            for key, x in (
                ("vf_loss", terms["objective"].detach().double()),
                ("vf_clipfrac", terms["clipped"].double()),
                ("value_mean", v),
                ("return_mean", r),
                ("return_sq", r * r),
                ("error_mean", err),
                ("error_sq", err * err),
            ):
                self.sums[key] += (x * s).sum()

    def reduce(self) -> dict[str, float]:
        keys = list(self.sums)
        total = dict(zip(keys, dist_sum(torch.stack([self.sums[k] for k in keys]), self.group).tolist()))
        var_r = total["return_sq"] - total["return_mean"] ** 2
        var_e = total["error_sq"] - total["error_mean"] ** 2
        return {
            "loss": total["vf_loss"],
            "vf_loss": total["vf_loss"],
            "vf_clipfrac": total["vf_clipfrac"],
            "value_mean": total["value_mean"],
            "return_mean": total["return_mean"],
            "explained_variance": 1.0 - var_e / var_r if var_r > 1e-12 else 0.0,
        }


@register_loss("value")
class Value(Objective):
    """PPO's clipped value loss (``value_token_terms``), normalised like the policy loss; metrics
    vf_loss, vf_clipfrac, value_mean, return_mean, explained_variance."""

    def begin(self, data, env) -> None:
        self.stats = ValueStats(env.device, env.group("loss"))

    def microbatch(self, model, mb, data, env):
        mb = mb.to(env.device)
        values = microbatch_values(model, mb, env.cp_group, route_rows=mb.sample_ids >= 0)
        terms = value_token_terms(
            values,
            loss_mask=mb.loss_mask,
            loss_weight=mb.loss_weight,
            returns=mb.returns,
            old_values=mb.old_values,
            cfg=self.cfg,
        )
        return window_objective(terms, mb, data, self.cfg, self.stats)

    def end(self, env) -> dict[str, float]:
        return self.stats.reduce()
