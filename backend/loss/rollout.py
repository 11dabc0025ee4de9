"""What the sampler saw: importance-correction weights and mismatch measures, per loss token.

Sampler and trainer never compute the same log-probabilities (kernels, precision, batch shape),
so rows carry the sampler's own, ``rollout_logprobs``. With ``old`` the trainer's old
log-probability of a loss token and ``rollout`` the sampler's, d = old - rollout and the
importance ratio is exp(d) (clamped to +-20 in the exponent, as verl's SAFETY_BOUND). The weight
is detached and multiplies the token's policy-gradient term (after the clip and the dual clip,
as verl's ``compute_policy_loss_vanilla`` applies ``rollout_is_weights``):

- ``tis``: clamp(exp(d), floor, cap). verl ``rollout_is="token"`` clamps at the cap only
  (``rollout_is_threshold``, 2.0); NeMo-RL's ``tis`` and OpenRLHF's ``tis`` also at a floor
  (NeMo-RL 0 by default, OpenRLHF [0.5, 5]): ``loss.rollout_correction_floor`` (0 = none).
- ``icepop``: exp(d) where floor <= exp(d) <= cap, else 0 (the token is masked out).
- ``seq_tis``: min(exp(sum of d over the sequence's loss tokens), cap), the same weight on each of
  its tokens (verl ``rollout_is="sequence"``).
- ``seq_mask_tis``: exp(d), untruncated, on every token of a sequence whose geometric-mean ratio
  exp(mean of d over its loss tokens) lies in [floor, cap]; 0 on every token of one outside.

Mismatch measures (the trainer's current log-probability ``lp`` against ``rollout``, at each loss
token; summed with the loss's own scale, so no plan changes them): ``token_mult_prob_error`` =
exp(|lp - rollout|) (NeMo-RL's definition: 1 when they agree), ``rollout_logprob_abs_diff`` =
|lp - rollout| (and its maximum), ``rollout_kl`` = exp(x) - x - 1 with x = lp - rollout (k3, as
NeMo-RL's ``gen_kl_error`` and verl's ``rollout_corr/k3_kl``), and the share of loss tokens whose
weight the correction changed (clamped or masked).

Read (formulas restated, no code copied): verl ``verl/trainer/ppo/rollout_corr_helper.py``
(``compute_rollout_correction_weights``) and ``verl/trainer/ppo/core_algos.py``; NeMo-RL
``nemo_rl/algorithms/loss/loss_functions.py`` (``ClippedPGLossFn``); OpenRLHF
``openrlhf/models/loss.py`` (``PolicyLoss``, ``vllm_is_correction_type``).

A sequence's sums run over its loss tokens wherever they sit: a padded row, a packed segment, and
across context-parallel ranks (``sequence_sum``, built by the caller from the microbatch's
layout, all-reduces over the CP group), so every plan gives every token the same weight.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

CORRECTIONS = ("none", "tis", "icepop", "seq_tis", "seq_mask_tis")
SAFETY_BOUND = 20.0  # |log ratio| before exp, as verl's SAFETY_BOUND: exp(20) = 4.9e8 stays finite

SequenceSum = Callable[[torch.Tensor], torch.Tensor]  # per-token values -> per-token sum over the sequence


def correction_weights(
    d: torch.Tensor,
    used: torch.Tensor,
    *,
    method: str,
    cap: float,
    floor: float,
    sequence_sum: SequenceSum | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, changed) per position for ``d`` = old - rollout (0 off the loss tokens), detached;
    off the loss tokens the weight is 1 and nothing is changed."""
    d = torch.where(used, d.detach(), torch.zeros_like(d))
    ratio = torch.exp(d.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    ones = torch.ones_like(ratio)
    if method == "tis":
        weight = ratio.clamp(min=floor, max=cap)
        changed = (ratio < floor) | (ratio > cap)
    elif method == "icepop":
        keep = (ratio >= floor) & (ratio <= cap)
        weight, changed = torch.where(keep, ratio, torch.zeros_like(ratio)), ~keep
    elif method in ("seq_tis", "seq_mask_tis"):
        if sequence_sum is None:
            raise ValueError(f"loss.rollout_correction={method} needs the microbatch's sequences (sequence_sum)")
        total = sequence_sum(d)
        if method == "seq_tis":
            seq_ratio = torch.exp(total.clamp(-SAFETY_BOUND, SAFETY_BOUND))
            weight, changed = seq_ratio.clamp(max=cap), seq_ratio > cap
        else:
            count = sequence_sum(used.to(d.dtype)).clamp_min(1)
            geo = torch.exp((total / count).clamp(-SAFETY_BOUND, SAFETY_BOUND))
            keep = (geo >= floor) & (geo <= cap)
            weight, changed = torch.where(keep, ratio, torch.zeros_like(ratio)), ~keep
    else:
        raise ValueError(f"loss.rollout_correction={method!r}: allowed values are {', '.join(CORRECTIONS)}")
    return torch.where(used, weight, ones), changed & used


def mismatch_terms(lp: torch.Tensor, rollout: torch.Tensor, used: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-position mismatch measures of the trainer's ``lp`` against the sampler's ``rollout``
    (0 off the loss tokens; see the module docstring)."""
    zeros = torch.zeros_like(lp)
    x = torch.where(used, lp.detach() - rollout.to(lp.dtype), zeros)
    gap = x.abs()
    return {
        "token_mult_prob_error": torch.where(used, torch.exp(gap.clamp(max=SAFETY_BOUND)), zeros),
        "rollout_logprob_abs_diff": gap,
        "rollout_kl": torch.where(used, torch.exp(x.clamp(-SAFETY_BOUND, SAFETY_BOUND)) - x - 1, zeros),
    }
