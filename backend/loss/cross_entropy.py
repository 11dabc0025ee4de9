"""The cross-entropy objective (``loss.type: cross_entropy``), as functions of per-token tensors.

    loss = sum over the window's target tokens of loss_weight_t x CE_t / N

N is the window's target-token count over every rank and microbatch, read from the dataset index
before the step (never a microbatch's count), so fixed and dynamic plans give the same gradient up
to FP32 summation order. Validation uses the same two functions over its fixed sample set.
"""

from __future__ import annotations

import torch

from backend.data.collate import MicrobatchTensors
from backend.distributed.collectives import dist_sum

from .outputs import microbatch_loss_sum_fused, microbatch_token_losses
from .registry import Objective, register_loss


def weighted_token_sum(token_losses: torch.Tensor, loss_weight: torch.Tensor) -> torch.Tensor:
    """sum(loss_weight x token cross-entropy) over one microbatch's positions (padding has weight 0)."""
    return (token_losses * loss_weight).sum()


def window_normaliser(loss_tokens: int) -> int:
    """The window's denominator: its target tokens (at least 1, so an empty window divides by 1)."""
    return max(1, int(loss_tokens))


def microbatch_loss_sum(model, mb: MicrobatchTensors, env, *, normaliser: int = 1) -> torch.Tensor:
    """sum(loss_weight * cross-entropy) over this rank's tokens of one microbatch; the caller divides
    it by ``normaliser`` before backward (so each loss's gradient is loss_weight / normaliser)."""
    mb = mb.to(env.device)
    fused = microbatch_loss_sum_fused(model, mb, env.cp_group, route_rows=mb.sample_ids >= 0)
    if fused is not None:  # model.logits_fused_kernel: the sum in one kernel, no per-token losses
        return fused
    hint = mb.loss_weight / normaliser if torch.is_grad_enabled() else None
    losses = microbatch_token_losses(model, mb, env.cp_group, route_rows=mb.sample_ids >= 0, grad_hint=hint)
    return weighted_token_sum(losses, mb.loss_weight)


@register_loss("cross_entropy")
class CrossEntropy(Objective):
    """sum(loss_weight x CE) over the window's target tokens / their count (``window_normaliser``)."""

    def begin(self, data, env) -> None:
        self.normaliser = window_normaliser(data.global_loss_tokens)
        self.local_sum = torch.zeros((), dtype=torch.float64, device=env.device)

    def microbatch(self, model, mb, data, env):
        loss_sum = microbatch_loss_sum(model, mb, env, normaliser=self.normaliser)
        self.local_sum += loss_sum.detach().double()
        return loss_sum / self.normaliser

    def end(self, env) -> dict[str, float]:
        return {"loss": (dist_sum(self.local_sum, env.group("loss")) / self.normaliser).item()}
