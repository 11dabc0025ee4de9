"""One optimizer step: the plan's microbatches, one loss normaliser, one update.

The loss of a window is sum(loss_weight * token cross-entropy) over every target token of the
window, divided by the window's target count (the same number on every rank, from the dataset
index). Because that denominator does not depend on how the window was cut into microbatches,
fixed and dynamic plans produce the same gradient up to floating-point summation order.

Every objective (``backend.loss.registry``: cross_entropy, policy, value) is handed to the step as
an object and normalised over the window in the same way (by its loss tokens, or per sequence
then over its sequences), so the objective, its gradient and every metric are independent of the
plan.

``train_step`` = ``forward_backward`` (gradients of the whole window) + ``apply_update`` (check,
clip, optimizer and scheduler step). Callers that must look at the gradients between the two (the
fixed-versus-dynamic comparison) call them separately.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

from backend.data.iterator import StepData
from backend.distributed.fsdp import clip_grad_norm, set_grad_sync
from backend.distributed.pipeline import broadcast_metrics, pipeline_order, run_pipeline, sum_tied_grads
from backend.errors import UserError
from backend.loss.outputs import microbatch_hidden, placeholder_microbatch
from backend.loss.registry import Objective, build_loss
from backend.model import moe_stats
from backend.model.tensor_parallel import plain_name, sum_partial_grads, tp_layout

# Called with the microbatch's index; the context it returns wraps that microbatch's forward and
# backward (the benchmark's saved-activation meter and per-microbatch timer use it).
MicrobatchHook = Callable[[int], AbstractContextManager]


class NonFiniteError(UserError, FloatingPointError):
    """A step whose loss or gradient norm is not finite, under ``train.nonfinite=stop`` (no update
    was applied); printed as one line naming the step and the value."""


def forward_backward(
    model,
    data: StepData,
    env,
    *,
    loss_cfg=None,
    objective: Objective | None = None,
    microbatch_hook: MicrobatchHook | None = None,
) -> dict:
    """Accumulate the window's gradient over this rank's microbatches with ``objective`` (default:
    the one ``loss_cfg.type`` names, cross-entropy without one); returns its ``end``: ``{"loss":
    window loss}`` and the objective's metrics. ``microbatch_hook(j)`` (optional) returns a context
    wrapped around microbatch j's forward and backward (the benchmark's activation meter and
    per-microbatch timer).

    MoE models add their load-balancing loss per microbatch as ``coeff * sum of per-sample switch
    losses / samples in the window`` (``backend.model.moe_stats``): independent of the plan. The
    returned loss is the objective only; ``moe_stats.window_metrics`` reports the rest.
    """
    objective = objective or build_loss(loss_cfg)
    objective.begin(data, env)
    backward_window(model, data, env, lambda mb: objective.microbatch(model, mb, data, env), microbatch_hook)
    end = objective.end(env)
    if env.pp_size > 1:  # the objective ran on the last stage: its window metrics on every stage
        end = broadcast_metrics(end, env)
    return end


def backward_window(model, data: StepData, env, microbatch_objective, microbatch_hook=None) -> None:
    """The one microbatch loop of every loss: gradient sync on the last microbatch only, empty
    microbatches as a placeholder (same collectives, zero gradient), ``microbatch_objective(mb)``
    (this microbatch's share of the window objective) plus its MoE aux loss, one backward each."""
    model.train()
    moe_stats.begin_window(model)
    samples = max(1, len(data.window_ids))
    count = len(data.microbatches)
    if env.pp_size > 1:  # the same microbatches, 1F1B through the stages (pipeline.py)
        _pipeline_window(model, data, env, microbatch_objective, microbatch_hook)
        return
    for j, mb in enumerate(data.microbatches):
        set_grad_sync(model, j == count - 1)
        with microbatch_hook(j) if microbatch_hook is not None else contextlib.nullcontext():
            total = microbatch_objective(placeholder_microbatch(env.cp_size, env.sp_size) if mb.is_empty else mb)
            aux = moe_stats.take_microbatch_aux(model)
            if aux is not None:
                total = total + aux / samples
            total.backward()
    sum_partial_grads(model)  # tensor parallelism: norms and QK-norms, partial on each TP rank


def _pipeline_window(model, data: StepData, env, microbatch_objective, microbatch_hook=None) -> None:
    """``backward_window`` under pipeline parallelism: this stage's part of every microbatch,
    scheduled 1F1B (``pipeline.run_pipeline``) in ``pipeline_order``; the tied embedding's two
    gradients summed; the stage's idle time kept on the model for the step row (``pipeline_bubble``)."""
    costs = [max(1, mb.cost) for mb in data.plan.microbatches(env.dp_rank)]
    order = pipeline_order(costs, env.pp_size, model.pipeline_order_rule)
    mbs = [data.microbatches[j] for j in order]
    mbs = [placeholder_microbatch(env.cp_size, env.sp_size) if mb.is_empty else mb for mb in mbs]
    mbs = [mb.to(env.device) for mb in mbs]

    samples = max(1, len(data.window_ids))

    def last_forward(j, mb):
        with microbatch_hook(order[j]) if microbatch_hook is not None else contextlib.nullcontext():
            total = microbatch_objective(mb)
            aux = moe_stats.take_microbatch_aux(model)  # this stage's MoE layers' share (as at PP 1)
            return total if aux is None else total + aux / samples

    def stage_forward(mb):
        out = microbatch_hidden(model, mb, env.cp_group, route_rows=mb.sample_ids >= 0)
        aux = moe_stats.take_microbatch_aux(model)
        return out, None if aux is None else aux / samples

    hidden = model.config.hidden_size
    times = run_pipeline(
        model,
        mbs,
        env,
        hidden=hidden,
        dtype=model.activation_dtype,
        last_forward=last_forward,
        stage_forward=stage_forward,
    )
    sum_partial_grads(model)
    sum_tied_grads(model, env)
    model.pipeline_times = times


def apply_update(
    model, optimizer, scheduler, *, loss: float, clip_grad: float, step: int, group, nonfinite: str = "stop"
) -> dict:
    """Clip, check and apply the accumulated gradient; returns grad_norm and the lr used. ``group``:
    the ranks whose gradient shards make up the whole (the gradient norm's sum).

    A loss or gradient norm that is not finite (both are sums over every rank, so every rank sees
    the same: a NaN on one rank reaches all of them) applies no update: ``nonfinite="stop"``
    raises ``NonFiniteError``; ``"skip"`` drops the gradient, steps the schedule (the step counts)
    and returns ``update_skipped`` 1."""
    layout = tp_layout(model)
    named = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
    params = [p for _, p in named]
    once = set(layout.splits) | set(layout.held_once)  # TP slices, and experts under EP: each element once
    copies = [1 if plain_name(n) in once else layout.size for n, _ in named] if layout.size > 1 else None
    stage = getattr(model, "stage_names", None)
    if stage is not None:  # pipeline: one sum over every stage's shards; the tied copy counted once (on stage 0)
        copies = copies or [1] * len(named)
        copies = [math.inf if plain_name(n) == stage.tied_copy else c for (n, _), c in zip(named, copies)]
    grad_norm = clip_grad_norm(params, clip_grad if clip_grad > 0 else math.inf, group=group, copies=copies)
    lr = optimizer.param_groups[0]["lr"]
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        optimizer.zero_grad(set_to_none=True)
        if nonfinite == "skip":
            scheduler.step()
            return {"grad_norm": grad_norm, "lr": lr, "update_skipped": 1}
        what = f"loss ({loss})" if not math.isfinite(loss) else f"gradient norm ({grad_norm})"
        raise NonFiniteError(f"step {step}: non-finite {what}; the update was not applied")
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return {"grad_norm": grad_norm, "lr": lr}


def train_step(
    model,
    optimizer,
    scheduler,
    data: StepData,
    env,
    *,
    clip_grad: float,
    step: int,
    microbatch_hook=None,
    loss_cfg=None,
    objective: Objective | None = None,
    nonfinite: str = "stop",
) -> dict:
    """Forward/backward every microbatch of ``data`` with ``objective`` (or ``loss_cfg``'s), check,
    clip, update (``nonfinite``: see ``apply_update``). Returns step metrics."""
    if env.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(env.device)
    start = time.perf_counter()
    window = forward_backward(model, data, env, loss_cfg=loss_cfg, objective=objective, microbatch_hook=microbatch_hook)
    moe = moe_stats.window_metrics(model, len(data.window_ids), env)  # {} for dense models
    out = apply_update(
        model,
        optimizer,
        scheduler,
        loss=window["loss"],
        clip_grad=clip_grad,
        step=step,
        group=env.group("world"),
        nonfinite=nonfinite,
    )
    if env.device.type == "cuda":
        torch.cuda.synchronize(env.device)
    return {**window, **out, **moe, "step_time_s": time.perf_counter() - start}
