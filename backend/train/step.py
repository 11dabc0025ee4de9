"""One optimizer step: the plan's microbatches, one loss normaliser, one update.

The loss of a window is sum(loss_weight * token cross-entropy) over every target token of the
window, divided by the window's target count (the same number on every rank, from the dataset
index). Because that denominator does not depend on how the window was cut into microbatches,
fixed and dynamic plans produce the same gradient up to floating-point summation order.
"""

from __future__ import annotations

import contextlib
import math
import time

import torch
import torch.distributed as dist

from backend.data.collate import MicrobatchTensors
from backend.data.iterator import StepData
from backend.model.builder import token_losses

from .wrap import set_grad_sync


class NonFiniteError(FloatingPointError):
    pass


def placeholder_microbatch(cp_size: int) -> MicrobatchTensors:
    """A one-row, 2*cp-token stand-in for an empty microbatch: it runs the same forward, backward
    and collectives as its peers, with zero loss weight, so it adds exactly zero gradient."""
    length = 2 * cp_size
    zeros = torch.zeros(1, 2, dtype=torch.int64)  # this rank's share of a 2*cp-token row
    return MicrobatchTensors(
        tokens=zeros,
        labels=zeros.clone(),
        loss_mask=torch.zeros(zeros.shape),
        loss_weight=torch.zeros(zeros.shape),
        position_ids=torch.arange(zeros.shape[1]).unsqueeze(0),
        valid=torch.ones(zeros.shape, dtype=torch.bool),
        seq_lengths=torch.tensor([length]),
        sample_ids=torch.tensor([-1]),
        padded_len=length,
    )


def microbatch_loss_sum(model, mb: MicrobatchTensors, env) -> torch.Tensor:
    """sum(loss_weight * cross-entropy) over this rank's tokens of one microbatch."""
    mb = mb.to(env.device)
    losses = token_losses(model, mb.tokens, mb.labels, mb.position_ids, mb.valid, cp_group=env.cp_group)
    return (losses * mb.loss_weight).sum()


def train_step(
    model, optimizer, scheduler, data: StepData, env, *, clip_grad: float, step: int, on_grads=None, meter=None
) -> dict:
    """Forward/backward every microbatch of ``data``, check, clip, update. Returns step metrics."""
    if env.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(env.device)
    start = time.perf_counter()
    model.train()
    normaliser = max(1, data.global_loss_tokens)
    local_sum = torch.zeros((), dtype=torch.float64, device=env.device)
    count = len(data.microbatches)
    for j, mb in enumerate(data.microbatches):
        set_grad_sync(model, j == count - 1)
        if meter is not None:  # CPU activation accounting (see backend.train.memory)
            meter.reset_microbatch()
        with meter.watch() if meter is not None else contextlib.nullcontext():
            loss_sum = microbatch_loss_sum(model, placeholder_microbatch(env.cp_size) if mb.is_empty else mb, env)
        (loss_sum / normaliser).backward()
        local_sum += loss_sum.detach().double()
    dist.all_reduce(local_sum)
    loss = (local_sum / normaliser).item()
    if on_grads is not None:  # e.g. to compare gradients across arms, before clipping
        on_grads(model)
    params = [p for p in model.parameters() if p.grad is not None]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, clip_grad if clip_grad > 0 else math.inf)
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        optimizer.zero_grad(set_to_none=True)
        raise NonFiniteError(
            f"step {step}: non-finite loss ({loss}) or gradient norm ({grad_norm}); the update was skipped"
        )
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    if env.device.type == "cuda":
        torch.cuda.synchronize(env.device)
    step_time = time.perf_counter() - start
    return {"loss": loss, "grad_norm": grad_norm, "lr": lr, "step_time_s": step_time}
