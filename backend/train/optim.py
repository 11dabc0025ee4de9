"""AdamW (no weight decay on norms and other 1-D weights) and the learning-rate schedules.

Every schedule starts with ``scheduler.warmup_iters`` steps of linear warm-up to ``optimizer.lr``,
then (``scheduler.type``):

- ``cosine`` (default): cosine decay to ``optimizer.min_lr`` at ``train.train_iters``.
- ``linear``: linear decay to ``optimizer.min_lr`` at ``train.train_iters``.
- ``constant``: ``optimizer.lr`` to the end.
- ``wsd`` (warmup-stable-decay; MiniCPM, Megatron's ``--lr-decay-style WSD``): ``optimizer.lr``
  until the last ``ceil(scheduler.decay_fraction * train.train_iters)`` steps, which decay to
  ``optimizer.min_lr`` with ``scheduler.decay_style``: ``linear`` (1 - p), ``cosine``
  ((1 + cos(pi p)) / 2) or ``sqrt`` (1 - sqrt(p)), p the progress through the decay in [0, 1].

The schedule is a pure function of the step (``lr_at``) wrapped in a ``LambdaLR``, so the
scheduler's state is its step counter alone and resumes from a checkpoint; a resumed run with a
longer ``train.train_iters`` follows the new horizon from the current step.
"""

from __future__ import annotations

import math

import torch

from backend.config.schema import DECAY_STYLES, SCHEDULE_TYPES, wsd_decay_iters


def build_optimizer(model: torch.nn.Module, opt_cfg) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": opt_cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=opt_cfg.lr,
        betas=(opt_cfg.adam_beta1, opt_cfg.adam_beta2),
        eps=opt_cfg.adam_eps,
    )


def _decay_factor(progress: float, style: str) -> float:
    """1 at progress 0, 0 at progress 1."""
    if style == "linear":
        return 1.0 - progress
    if style == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if style == "sqrt":
        return 1.0 - math.sqrt(progress)
    raise ValueError(f"scheduler.decay_style={style!r}: allowed values are {', '.join(DECAY_STYLES)}")


def lr_at(
    step: int,
    *,
    lr: float,
    min_lr: float,
    warmup: int,
    total: int,
    kind: str = "cosine",
    decay_fraction: float = 0.1,
    decay_style: str = "linear",
) -> float:
    """Learning rate for optimizer step ``step`` (0-based) under schedule ``kind``."""
    if warmup and step < warmup:
        return lr * (step + 1) / warmup
    if kind == "constant":
        return lr
    if kind == "wsd":
        decay = wsd_decay_iters(decay_fraction, total)
        start = max(warmup, total - decay)
        if step < start:
            return lr
        progress = min(1.0, (step - start) / max(1, total - start))
        return min_lr + (lr - min_lr) * _decay_factor(progress, decay_style)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if kind == "cosine":
        return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if kind == "linear":
        return min_lr + (lr - min_lr) * (1.0 - progress)
    raise ValueError(f"scheduler.type={kind!r}: allowed values are {', '.join(SCHEDULE_TYPES)}")


def schedule_kwargs(opt_cfg, sched_cfg, train_iters: int) -> dict:
    """The keyword arguments of ``lr_at`` (all but the step) for a config."""
    return dict(
        lr=opt_cfg.lr,
        min_lr=opt_cfg.min_lr,
        warmup=sched_cfg.warmup_iters,
        total=train_iters,
        kind=getattr(sched_cfg, "type", "cosine"),
        decay_fraction=getattr(sched_cfg, "decay_fraction", 0.1),
        decay_style=getattr(sched_cfg, "decay_style", "linear"),
    )


def build_scheduler(optimizer, opt_cfg, sched_cfg, train_iters: int) -> torch.optim.lr_scheduler.LambdaLR:
    kwargs = schedule_kwargs(opt_cfg, sched_cfg, train_iters)
    lr_at(0, **kwargs)  # an unknown type or style fails here, not at the first step

    def factor(step: int) -> float:
        # lr 0 (a frozen control run) has every factor 0: base lr x anything is 0
        return lr_at(step, **kwargs) / opt_cfg.lr if opt_cfg.lr else 0.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
