"""The cross-entropy objective (``loss.type: cross_entropy``), as functions of per-token tensors.

    loss = sum over the window's target tokens of loss_weight_t x CE_t / N

N is the window's target-token count over every rank and microbatch, read from the dataset index
before the step (never a microbatch's count), so fixed and dynamic plans give the same gradient up
to FP32 summation order. Validation uses the same two functions over its fixed sample set.
"""

from __future__ import annotations

import torch


def weighted_token_sum(token_losses: torch.Tensor, loss_weight: torch.Tensor) -> torch.Tensor:
    """sum(loss_weight x token cross-entropy) over one microbatch's positions (padding has weight 0)."""
    return (token_losses * loss_weight).sum()


def window_normaliser(loss_tokens: int) -> int:
    """The window's denominator: its target tokens (at least 1, so an empty window divides by 1)."""
    return max(1, int(loss_tokens))
