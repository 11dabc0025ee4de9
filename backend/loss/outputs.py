"""What a loss reads from the model, one microbatch at a time: per-position cross-entropy,
log-probabilities (and entropy) or values, each [rows, s_local] in FP32 on this rank's share of the
microbatch, and the placeholder an empty microbatch runs instead (same collectives, zero weight).

The objectives (``registry``) and forward-only passes (``backend.train.forward_only``) call these;
the model side (``backend.model.builder``'s ``token_*`` functions) knows nothing of microbatches.
"""

from __future__ import annotations

import torch

from backend.data.collate import MicrobatchTensors
from backend.distributed.collectives import dist_sum
from backend.model.forward import stage_hidden, token_logprobs, token_loss_sum, token_losses, token_values


def placeholder_microbatch(cp_size: int, sp_size: int = 1) -> MicrobatchTensors:
    """A one-row, 2*cp*sp-token stand-in for an empty microbatch: it runs the same forward, backward
    and collectives as its peers, with zero loss weight, so it adds exactly zero gradient. Its
    share on a CP rank, 2 x sp tokens, splits over the sequence-parallel ranks."""
    length = 2 * cp_size * sp_size
    zeros = torch.zeros(1, 2 * sp_size, dtype=torch.int64)  # this rank's share of the row
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


def microbatch_loss_sum_fused(model, mb: MicrobatchTensors, cp_group=None, *, route_rows=None) -> torch.Tensor | None:
    """sum(loss_weight x cross-entropy) of one microbatch by the model's fused kernel, or None
    (none configured, or weights other than 0 and 1): ``forward.token_loss_sum``."""
    inputs = (mb.tokens, mb.labels, mb.position_ids, mb.valid, mb.loss_weight)
    return token_loss_sum(model, *inputs, cp_group=cp_group, route_rows=route_rows, segments=_segments(mb))


def microbatch_values(model, mb: MicrobatchTensors, cp_group=None, *, route_rows=None) -> torch.Tensor:
    """A critic's values [rows, s_local] (FP32) of one microbatch on its device, aligned like the
    labels: entry i values the state before the token at i + 1."""
    return token_values(
        model, mb.tokens, mb.position_ids, mb.valid, cp_group=cp_group, route_rows=route_rows, segments=_segments(mb)
    )


def microbatch_hidden(model, mb: MicrobatchTensors, cp_group=None, *, route_rows=None) -> torch.Tensor:
    """A pipeline stage's output hidden states [s_local / sp, rows, hidden] for one microbatch on
    its device (a stage before the last: no output layer, no loss)."""
    return stage_hidden(
        model, mb.tokens, mb.position_ids, mb.valid, cp_group=cp_group, route_rows=route_rows, segments=_segments(mb)
    )
