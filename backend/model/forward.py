"""The model's forward API, one microbatch at a time: per-position cross-entropy, logits,
log-probabilities (and entropy) or a critic's values, with our attention context (positions,
validity, CP group, packed segments) and the MoE router statistics' context.

How the output layer is evaluated is one explicit object, ``OutputSettings``, set by the model
factory (``set_output_settings``) and read here: chunked logits (``model.logits_chunk_tokens``),
and the vocabulary limit (rows we padded onto the tokenizer's vocabulary never enter the softmax).
A model built outside the factory has the defaults. MoE models carry their router statistics
(``moe_stats.install``); a forward runs inside their routing context when they do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import moe_stats
from .attention import AttentionContext
from .output import OutputRequest, output_request
from .vocab_parallel import vocab_parallel_logprobs


@dataclass(frozen=True)
class OutputSettings:
    logits_chunk_tokens: int = 0  # > 0: the output layer a chunk of tokens at a time (output.py)
    vocab_limit: int | None = None  # the tokenizer's vocabulary when we padded the embedding past it
    fused_kernel: str = "none"  # "liger": the cross-entropy sum by Liger's fused kernel (token_loss_sum)


def set_output_settings(model: torch.nn.Module, settings: OutputSettings) -> None:
    model.output_settings = settings


def output_settings(model) -> OutputSettings:
    """The settings the factory gave ``model`` (defaults for a model built elsewhere)."""
    return getattr(model, "output_settings", None) or OutputSettings()


def tp_group_of(model):
    """The output layer's tensor-parallel group when the vocabulary is split over more than one
    rank (megatron-core's layers hold it), else None."""
    group = getattr(getattr(model, "output_layer", None), "tp_group", None)
    return group if group is not None and group.size() > 1 else None


def _forward(model, tokens, labels, positions, valid, *, cp_group, route_rows, segments):
    """The model on one microbatch: per-position cross-entropy [b, s] with ``labels``, else logits [b, s, V]."""
    ctx = AttentionContext(positions=positions, valid=valid, cp_group=cp_group, **(segments or {}))
    if moe_stats.stats_of(model) is not None:
        groups = segments["segment_ids"] if segments else None
        with moe_stats.routing_context(model, valid, cp_group=cp_group, rows=route_rows, groups=groups):
            return model(tokens, positions, ctx, labels=labels, padding_mask=~valid)
    return model(tokens, positions, ctx, labels=labels)


def token_losses(
    model,
    tokens,
    labels,
    positions,
    valid,
    *,
    cp_group=None,
    route_rows=None,
    segments: dict | None = None,
    grad_hint: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-position cross-entropy [b, s] (FP32), computed by megatron-core from the labels.

    MoE models also get ``padding_mask`` (True at padding, megatron-core's convention), so padding
    never enters megatron-core's own router bookkeeping; ours (``moe_stats``) reads ``valid`` and
    ``route_rows`` (one bool per sample: False for samples that must not count, the zero-weight
    placeholder). ``segments`` (packed rows): ``segment_ids``, ``cu_seqlens``, ``cu_seqlens_padded``
    for the attention context, so attention stays within each packed sequence, and the router
    statistics are per packed sequence (a sample), as they are per row when padded.
    """
    settings = output_settings(model)
    if settings.logits_chunk_tokens or settings.vocab_limit:
        # chunked logits, or a padded vocabulary kept out of the softmax: through log p (the same
        # number as megatron-core's cross-entropy to FP32 rounding)
        lp, _ = token_logprobs(
            model,
            tokens,
            labels,
            positions,
            valid,
            cp_group=cp_group,
            route_rows=route_rows,
            segments=segments,
            grad_hint=None if grad_hint is None else -grad_hint,  # the losses are -log p
        )
        return -lp
    return _forward(
        model, tokens, labels, positions, valid, cp_group=cp_group, route_rows=route_rows, segments=segments
    ).float()


def token_loss_sum(
    model, tokens, labels, positions, valid, loss_weight, *, cp_group=None, route_rows=None, segments=None
) -> torch.Tensor | None:
    """sum(loss_weight x cross-entropy) over the microbatch's positions in one fused kernel
    (``OutputSettings.fused_kernel``: Liger's fused linear cross-entropy, which never holds the
    logits), or None when the model has none or a weight is neither 0 nor 1 (the kernel takes a
    token or ignores it): the caller then computes per-token losses as usual."""
    settings = output_settings(model)
    if settings.fused_kernel != "liger" or not bool(((loss_weight == 0) | (loss_weight == 1)).all()):
        return None
    request = OutputRequest(
        torch.where(loss_weight > 0, labels, torch.full_like(labels, -100)),
        0,
        vocab_limit=settings.vocab_limit,
        fused="liger",
    )
    with output_request(model, request):
        out = _forward(
            model, tokens, None, positions, valid, cp_group=cp_group, route_rows=route_rows, segments=segments
        )
    return out[0, 0, 0]


def token_values(model, tokens, positions, valid, *, cp_group=None, route_rows=None, segments=None) -> torch.Tensor:
    """A critic's value at each position [b, s] (FP32): the head's output on the position's hidden
    state, so entry i values the state before token i + 1 (aligned like the labels)."""
    out = _forward(model, tokens, None, positions, valid, cp_group=cp_group, route_rows=route_rows, segments=segments)
    return out[..., 0].float()


def stage_hidden(model, tokens, positions, valid, *, cp_group=None, route_rows=None, segments=None) -> torch.Tensor:
    """A pipeline stage before the last: its decoder layers' output [s, b, hidden] (megatron-core's
    layout), which the next stage takes as its input (``backend.train.pipeline``)."""
    return _forward(model, tokens, None, positions, valid, cp_group=cp_group, route_rows=route_rows, segments=segments)


def token_logits(model, tokens, positions, valid, *, cp_group=None, route_rows=None, segments=None) -> torch.Tensor:
    """The model's logits [b, s, V] (in the compute dtype) for one microbatch; under tensor
    parallelism this rank's slice [b, s, V / tp] (``vocab_parallel``)."""
    return _forward(model, tokens, None, positions, valid, cp_group=cp_group, route_rows=route_rows, segments=segments)


def token_logprobs(
    model,
    tokens,
    labels,
    positions,
    valid,
    *,
    entropy: str = "",
    cp_group=None,
    route_rows=None,
    segments: dict | None = None,
    temperature: float = 1.0,
    grad_hint: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(label), full-vocabulary entropy or None), each [b, s] in FP32, from the logits.
    ``entropy``: "" (not computed), "value" (no gradient: a metric; autograd keeps no softmax
    for it) or "grad" (differentiable: an entropy bonus in the loss). ``temperature``: the logits
    are divided by it first (``loss.temperature``: the sampler's, as verl, NeMo-RL and OpenRLHF
    do), so log p and H are those of the distribution the sampler drew from; 1 skips the division.

    The policy loss needs both, and the entropy needs every logit, so this path asks the model for
    logits (megatron-core's labels path returns only the cross-entropy). lp = logit[label] -
    logsumexp(logits) is the same number as -cross-entropy to FP32 rounding; H = logsumexp -
    sum(softmax * logits). Memory: one FP32 copy of the logits (and its softmax when H is wanted),
    unless the model was built with ``model.logits_chunk_tokens`` (``backend.model.output``: a
    chunk's logits at a time). ``OutputSettings.vocab_limit`` (the tokenizer's vocabulary when we padded
    the embedding) keeps padding rows out of the softmax and the entropy on either path.
    """
    settings = output_settings(model)
    chunk, limit = settings.logits_chunk_tokens, settings.vocab_limit
    if chunk:
        request = OutputRequest(labels, chunk, temperature, entropy, limit, grad_hint)
        with output_request(model, request):
            out = _forward(
                model, tokens, None, positions, valid, cp_group=cp_group, route_rows=route_rows, segments=segments
            )
        return out[..., 0], (out[..., 1] if entropy else None)
    logits = token_logits(model, tokens, positions, valid, cp_group=cp_group, route_rows=route_rows, segments=segments)
    tp = tp_group_of(model)
    if tp is not None:  # this rank's slice of the vocabulary: nothing gathered (vocab_parallel)
        return vocab_parallel_logprobs(logits, labels, tp, vocab_limit=limit, temperature=temperature, entropy=entropy)
    logits = logits.float()
    if limit:
        logits = logits[..., :limit]
    if temperature != 1.0:
        logits = logits / temperature
    norm = torch.logsumexp(logits, dim=-1)
    lp = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - norm
    if not entropy:
        return lp, None
    with torch.set_grad_enabled(entropy == "grad" and torch.is_grad_enabled()):
        return lp, norm - (torch.softmax(logits, dim=-1) * logits).sum(-1)
