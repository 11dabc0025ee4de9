"""One optimizer step: the plan's microbatches, one loss normaliser, one update.

The loss of a window is sum(loss_weight * token cross-entropy) over every target token of the
window, divided by the window's target count (the same number on every rank, from the dataset
index). Because that denominator does not depend on how the window was cut into microbatches,
fixed and dynamic plans produce the same gradient up to floating-point summation order.

With ``loss.type=policy`` the loss is the PPO/GRPO objective (``policy_loss``), normalised over
the window in the same way (by its loss tokens, or per sequence then over its sequences), so the
objective, its gradient and every metric are again independent of the plan.

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

from backend.data.collate import MicrobatchTensors
from backend.data.iterator import StepData
from backend.distributed.collectives import dist_sum
from backend.distributed.fsdp import clip_grad_norm, set_grad_sync
from backend.loss.cross_entropy import weighted_token_sum, window_normaliser
from backend.loss.policy import WindowStats, policy_token_terms, token_scale
from backend.loss.value import ValueStats, value_token_terms
from backend.model import moe_stats
from backend.model.builder import token_logprobs, token_losses, token_values

# Called with the microbatch's index; the context it returns wraps that microbatch's forward and
# backward (the benchmark's saved-activation meter and per-microbatch timer use it).
MicrobatchHook = Callable[[int], AbstractContextManager]


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


def _segments(mb: MicrobatchTensors) -> dict | None:
    """Packed microbatches carry their segment facts (sequence ids, cu_seqlens) into the attention
    context, so attention stays within each sequence."""
    if not mb.is_packed:
        return None
    return {"segment_ids": mb.segment_ids, "cu_seqlens": mb.cu_seqlens, "cu_seqlens_padded": mb.cu_seqlens_padded}


def microbatch_logprobs(
    model, mb: MicrobatchTensors, cp_group=None, *, entropy: str = "", route_rows=None, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(label), entropy or None), each [rows, s_local] FP32, of one microbatch on its device
    (``entropy``: "" none, "value" measured without gradient, "grad" differentiable), of the
    distribution softmax(logits / ``temperature``)."""
    inputs = (mb.tokens, mb.labels, mb.position_ids, mb.valid)
    return token_logprobs(
        model,
        *inputs,
        entropy=entropy,
        cp_group=cp_group,
        route_rows=route_rows,
        segments=_segments(mb),
        temperature=temperature,
    )


def sequence_sum(mb: MicrobatchTensors, cp_group=None):
    """A function summing a per-position tensor [rows, s_local] over each position's sequence (a
    padded row, or a packed segment) across the CP ranks, handed back per position: the
    sequence-level rollout corrections need a sequence's whole sum wherever its tokens sit."""

    def reduce(sums: torch.Tensor) -> torch.Tensor:
        return dist_sum(sums, cp_group) if cp_group is not None else sums

    if mb.is_packed:
        index = mb.segment_ids[0].long()
        count = len(mb.seq_lengths)

        def packed(x: torch.Tensor) -> torch.Tensor:
            sums = torch.zeros(count, dtype=x.dtype, device=x.device).index_add_(0, index, x[0])
            return reduce(sums)[index].unsqueeze(0)

        return packed

    def padded(x: torch.Tensor) -> torch.Tensor:
        return reduce(x.sum(dim=1)).unsqueeze(1).expand_as(x)

    return padded


def microbatch_token_losses(
    model, mb: MicrobatchTensors, cp_group=None, *, route_rows=None, grad_hint=None
) -> torch.Tensor:
    """Per-position cross-entropy [rows, s_local] (FP32) of one microbatch already on its device
    (``grad_hint``: the gradient the losses will receive, for the chunked output layer)."""
    inputs = (mb.tokens, mb.labels, mb.position_ids, mb.valid)
    return token_losses(
        model, *inputs, cp_group=cp_group, route_rows=route_rows, segments=_segments(mb), grad_hint=grad_hint
    )


def microbatch_loss_sum(model, mb: MicrobatchTensors, env, *, normaliser: int = 1) -> torch.Tensor:
    """sum(loss_weight * cross-entropy) over this rank's tokens of one microbatch; the caller divides
    it by ``normaliser`` before backward (so each loss's gradient is loss_weight / normaliser)."""
    mb = mb.to(env.device)
    hint = mb.loss_weight / normaliser if torch.is_grad_enabled() else None
    losses = microbatch_token_losses(model, mb, env.cp_group, route_rows=mb.sample_ids >= 0, grad_hint=hint)
    return weighted_token_sum(losses, mb.loss_weight)


def forward_backward(
    model,
    data: StepData,
    env,
    *,
    loss_cfg=None,
    microbatch_hook: MicrobatchHook | None = None,
) -> dict:
    """Accumulate the window's gradient over this rank's microbatches; returns ``{"loss": window
    loss}`` (and, for ``loss_cfg.type == "policy"``, the policy metrics: ``policy_forward_backward``).
    ``microbatch_hook(j)`` (optional) returns a context wrapped around microbatch j's forward and
    backward (the benchmark's activation meter and per-microbatch timer).

    MoE models add their load-balancing loss per microbatch as ``coeff * sum of per-sample switch
    losses / samples in the window`` (``backend.model.moe_stats``): independent of the plan. The
    returned loss is the language-model loss only; ``moe_stats.window_metrics`` reports the rest.
    """
    if loss_cfg is not None and loss_cfg.type == "policy":
        return policy_forward_backward(model, data, env, loss_cfg, microbatch_hook=microbatch_hook)
    if loss_cfg is not None and loss_cfg.type == "value":
        return value_forward_backward(model, data, env, loss_cfg, microbatch_hook=microbatch_hook)
    normaliser = window_normaliser(data.global_loss_tokens)
    local_sum = torch.zeros((), dtype=torch.float64, device=env.device)

    def microbatch_objective(mb: MicrobatchTensors) -> torch.Tensor:
        nonlocal local_sum
        loss_sum = microbatch_loss_sum(model, mb, env, normaliser=normaliser)
        local_sum += loss_sum.detach().double()
        return loss_sum / normaliser

    backward_window(model, data, env, microbatch_objective, microbatch_hook)
    return {"loss": (dist_sum(local_sum, env.group("loss")) / normaliser).item()}


def backward_window(model, data: StepData, env, microbatch_objective, microbatch_hook=None) -> None:
    """The one microbatch loop of every loss: gradient sync on the last microbatch only, empty
    microbatches as a placeholder (same collectives, zero gradient), ``microbatch_objective(mb)``
    (this microbatch's share of the window objective) plus its MoE aux loss, one backward each."""
    model.train()
    moe_stats.begin_window(model)
    samples = max(1, len(data.window_ids))
    count = len(data.microbatches)
    for j, mb in enumerate(data.microbatches):
        set_grad_sync(model, j == count - 1)
        with microbatch_hook(j) if microbatch_hook is not None else contextlib.nullcontext():
            total = microbatch_objective(placeholder_microbatch(env.cp_size) if mb.is_empty else mb)
            aux = moe_stats.take_microbatch_aux(model)
            if aux is not None:
                total = total + aux / samples
            total.backward()


def window_objective(terms: dict, mb: MicrobatchTensors, data: StepData, loss_cfg, stats) -> torch.Tensor:
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


def policy_forward_backward(model, data: StepData, env, loss_cfg, *, microbatch_hook=None) -> dict:
    """The policy objective's gradient over the window (``policy_loss``): per microbatch, the
    log-probabilities and entropy from the logits, the per-token terms, each token scaled by its
    window share (token or sequence normalisation), one backward. Returns ``loss`` (the window's
    objective), pg_loss, kl (when kl_coef > 0), entropy, clipfrac, approx_kl, ratio_min, ratio_max."""
    stats = WindowStats(env.device, env.group("loss"))

    def microbatch_objective(mb: MicrobatchTensors) -> torch.Tensor:
        mb = mb.to(env.device)
        # The entropy is always measured (a metric); it joins the graph only when it is in the loss.
        entropy = "grad" if loss_cfg.entropy_coef else "value"
        lp, h = microbatch_logprobs(
            model, mb, env.cp_group, entropy=entropy, route_rows=mb.sample_ids >= 0, temperature=loss_cfg.temperature
        )
        terms = policy_token_terms(
            lp,
            h,
            loss_mask=mb.loss_mask,
            loss_weight=mb.loss_weight,
            advantages=mb.advantages,
            old_logprobs=mb.old_logprobs,
            ref_logprobs=mb.ref_logprobs,
            cfg=loss_cfg,
            rollout_logprobs=mb.rollout_logprobs,
            sequence_sum=sequence_sum(mb, env.cp_group if env.cp_size > 1 else None),
        )
        return window_objective(terms, mb, data, loss_cfg, stats)

    backward_window(model, data, env, microbatch_objective, microbatch_hook)
    return stats.reduce(kl=bool(loss_cfg.kl_coef), entropy=True)


def microbatch_values(model, mb: MicrobatchTensors, cp_group=None, *, route_rows=None) -> torch.Tensor:
    """A critic's values [rows, s_local] (FP32) of one microbatch on its device, aligned like the
    labels: entry i values the state before the token at i + 1."""
    return token_values(
        model, mb.tokens, mb.position_ids, mb.valid, cp_group=cp_group, route_rows=route_rows, segments=_segments(mb)
    )


def value_forward_backward(model, data: StepData, env, loss_cfg, *, microbatch_hook=None) -> dict:
    """PPO's clipped value loss over the window (``backend/loss/value.py``), normalised like the
    policy loss (token or sequence, the window's denominators). Returns ``loss`` (= vf_loss),
    vf_clipfrac, value_mean, return_mean, explained_variance."""
    stats = ValueStats(env.device, env.group("loss"))

    def microbatch_objective(mb: MicrobatchTensors) -> torch.Tensor:
        mb = mb.to(env.device)
        values = microbatch_values(model, mb, env.cp_group, route_rows=mb.sample_ids >= 0)
        terms = value_token_terms(
            values,
            loss_mask=mb.loss_mask,
            loss_weight=mb.loss_weight,
            returns=mb.returns,
            old_values=mb.old_values,
            cfg=loss_cfg,
        )
        return window_objective(terms, mb, data, loss_cfg, stats)

    backward_window(model, data, env, microbatch_objective, microbatch_hook)
    return stats.reduce()


def apply_update(model, optimizer, scheduler, *, loss: float, clip_grad: float, step: int, group) -> dict:
    """Clip, check and apply the accumulated gradient; returns grad_norm and the lr used. ``group``:
    the ranks whose gradient shards make up the whole (the gradient norm's sum)."""
    params = [p for p in model.parameters() if p.grad is not None]
    grad_norm = clip_grad_norm(params, clip_grad if clip_grad > 0 else math.inf, group=group)
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        optimizer.zero_grad(set_to_none=True)
        raise NonFiniteError(
            f"step {step}: non-finite loss ({loss}) or gradient norm ({grad_norm}); the update was skipped"
        )
    lr = optimizer.param_groups[0]["lr"]
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
) -> dict:
    """Forward/backward every microbatch of ``data``, check, clip, update. Returns step metrics."""
    if env.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(env.device)
    start = time.perf_counter()
    window = forward_backward(model, data, env, loss_cfg=loss_cfg, microbatch_hook=microbatch_hook)
    moe = moe_stats.window_metrics(model, len(data.window_ids), env)  # {} for dense models
    out = apply_update(
        model, optimizer, scheduler, loss=window["loss"], clip_grad=clip_grad, step=step, group=env.group("world")
    )
    if env.device.type == "cuda":
        torch.cuda.synchronize(env.device)
    return {**window, **out, **moe, "step_time_s": time.perf_counter() - start}
