"""The FlexAttention kernel: padded and packed rows (a document mask whose ``BlockMask`` skips every
block outside the rule of ``masks``), sliding windows in the mask and learnable sinks through the
log-sum-exp. One compiled ``flex_attention`` serves every layer and mask (compiled on CUDA; eager
and forward-only on CPU, where FlexAttention has no backward).

**Sinks.** With ``Z = sum_j exp(l_j)`` over the allowed keys and ``lse = log Z`` (flex returns
it), the sink-free output is ``o = sum_j exp(l_j) v_j / Z``, hence

    out = o * Z / (Z + exp(s_h)) = o * sigmoid(lse - s_h)

(computed in FP32). A query with no allowed key has ``o = 0`` and ``lse = -inf``, so out = 0 (all
mass on the sink), as on SDPA. The gradient reaches ``s_h`` (and q, k through ``lse``) via the
sigmoid; on CUDA the backward needs flex's gradient of ``lse``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from .context import AttentionContext
from .masks import block_mask


@functools.cache
def compiled_flex_attention() -> Callable:
    """``torch.compile(flex_attention)``: one instance for every layer, window and mask."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _flex(q: torch.Tensor) -> Callable:
    from torch.nn.attention.flex_attention import flex_attention

    return compiled_flex_attention() if q.is_cuda else flex_attention


def flex_sink_attention(q, k, v, block_mask, *, sinks: torch.Tensor | None = None, scale: float) -> torch.Tensor:
    """[b, h, sq, d] attention under ``block_mask`` (``masks``), with optional ``sinks`` [h]."""
    from torch.nn.attention.flex_attention import AuxRequest

    fn = _flex(q)
    gqa = q.shape[1] != k.shape[1]
    if sinks is None:
        return fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    h = q.shape[1]
    if sinks.shape != (h,):
        raise ValueError(f"sinks must have shape ({h},) (one per query head), got {tuple(sinks.shape)}")
    out, aux = fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa, return_aux=AuxRequest(lse=True))
    keep = torch.sigmoid(aux.lse.float() - sinks.float()[None, :, None])  # [b, h, sq]: Z / (Z + e^s)
    return (out.float() * keep[..., None]).to(q.dtype)


def flex_attention_kernel(
    q, k, v, ctx: AttentionContext, scale: float, *, window: int = 0, sinks: torch.Tensor | None = None
) -> torch.Tensor:
    """The kernel: q [b, h, sq, d], k / v [b, hk, sk, d] (CP-gathered) -> [b, h, sq, d]."""
    mask = block_mask(ctx, window)
    if not window and sinks is None:
        return _flex(q)(q, k, v, block_mask=mask, scale=scale, enable_gqa=True)
    return flex_sink_attention(q, k, v, mask, sinks=sinks, scale=scale)
