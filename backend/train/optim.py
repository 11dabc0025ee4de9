"""AdamW (no weight decay on norms and other 1-D weights) and linear warmup + cosine decay."""

from __future__ import annotations

import math

import torch


def build_optimizer(model: torch.nn.Module, opt_cfg) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": opt_cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=opt_cfg.lr,
        betas=(opt_cfg.adam_beta1, opt_cfg.adam_beta2),
        eps=opt_cfg.adam_eps,
    )


def lr_at(step: int, *, lr: float, min_lr: float, warmup: int, total: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based)."""
    if warmup and step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer, opt_cfg, sched_cfg, train_iters: int) -> torch.optim.lr_scheduler.LambdaLR:
    def factor(step: int) -> float:
        return (
            lr_at(step, lr=opt_cfg.lr, min_lr=opt_cfg.min_lr, warmup=sched_cfg.warmup_iters, total=train_iters)
            / opt_cfg.lr
        )

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
