"""Attention with learnable per-head sinks and sliding windows (GPT-OSS), for the sdpa and flex kernels.

Same conventions as ``backend.model.attention``: q [b, h, sq, d], k/v [b, hk, sk, d] (grouped-query
when hk < h), the padded layout, and masks built from *global* token positions, so context
parallelism (each rank holding two chunks of every row, keys gathered from the CP group in any
order) needs no special case.

**Window.** ``window = W > 0`` lets a query at global position p attend a key at position j iff
``p - W < j <= p`` and the key is valid (not padding): the W most recent positions, itself
included. This is transformers' ``sliding_window = W`` (``kv_idx > q_idx - W`` and causal) and
megatron-core / Transformer Engine's ``window_size = (W - 1, 0)``. ``window = 0`` is full causal.

**Sinks.** Each head h has a learnable logit ``s_h`` (GPT-OSS ``self_attn.sinks``, megatron-core's
``softmax_offset`` with ``softmax_type="learnable"``): an extra key every query sees, with logit
``s_h`` (not scaled) and a zero value. It takes probability mass and contributes nothing:

    out = sum_j exp(l_j) v_j / (exp(s_h) + sum_j exp(l_j))

- sdpa: the sink is appended as one more key whose value row is 0; its logit comes from the
  additive float mask (``s_h`` in the sink column, 0 / -inf elsewhere). SDPA differentiates the
  float mask, so the sinks get their gradients. The mask is materialised per head,
  [b, h, sq, sk + 1] in the compute dtype (the price of exactness on SDPA).
- flex: the window is in the ``mask_mod``; the sink enters through the log-sum-exp flex returns.
  With ``Z = sum_j exp(l_j)`` (allowed keys only) and ``lse = log Z``, the sink-free output is
  ``o = sum_j exp(l_j) v_j / Z``, hence

      out = o * Z / (Z + exp(s_h)) = o * sigmoid(lse - s_h)

  (computed in FP32). A query with no allowed key has ``o = 0`` and ``lse = -inf``, so out = 0
  (all mass on the sink), the same as the sdpa path. The gradient reaches ``s_h`` (and q, k
  through ``lse``) via the sigmoid; FlexAttention has no CPU backward, so on CPU this path is
  forward-only (tested against sdpa), and on CUDA its backward needs flex's gradient of ``lse``.

Rows with no allowed key and no sink (padding queries far past a row's end under a window, or an
empty row) would be fully masked; they are given an arbitrary finite row and a zero output, so no
NaN can reach the backward pass.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

# ---- masks ---------------------------------------------------------------------------------------


def allowed_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, k_valid: torch.Tensor, window: int = 0) -> torch.Tensor:
    """[b, 1, sq, sk] bool: True where a query may attend a key (causal on global positions,
    within ``window`` when it is positive, valid keys only). q_pos [b, sq], k_pos/k_valid [b, sk]."""
    if window < 0:
        raise ValueError(f"window must be 0 (full) or positive, got {window}")
    qp, kp = q_pos[:, :, None], k_pos[:, None, :]
    allowed = (kp <= qp) & k_valid[:, None, :]
    if window:
        allowed &= kp > qp - window
    return allowed[:, None]


def window_mask_mod(q_pos: torch.Tensor, k_pos: torch.Tensor, k_valid: torch.Tensor, window: int = 0) -> Callable:
    """The flex ``mask_mod`` of ``allowed_mask`` (indices into the local padded layout)."""

    if window:

        def mask_mod(b, h, q_idx, kv_idx):
            qp, kp = q_pos[b, q_idx], k_pos[b, kv_idx]
            return (kp <= qp) & (kp > qp - window) & k_valid[b, kv_idx]

    else:

        def mask_mod(b, h, q_idx, kv_idx):
            return (k_pos[b, kv_idx] <= q_pos[b, q_idx]) & k_valid[b, kv_idx]

    return mask_mod


def flex_block_mask(q_pos, k_pos, k_valid, window: int = 0, *, block_size: int = 128):
    """A flex ``BlockMask`` for ``allowed_mask`` (blocks outside the window or all padding are skipped)."""
    from torch.nn.attention.flex_attention import create_block_mask

    b, sq, sk = q_pos.shape[0], q_pos.shape[1], k_pos.shape[1]
    mask_mod = window_mask_mod(q_pos, k_pos, k_valid, window)
    return create_block_mask(mask_mod, b, None, sq, sk, device=q_pos.device, BLOCK_SIZE=block_size)


# ---- kernels -------------------------------------------------------------------------------------


def sdpa_sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    k_valid: torch.Tensor,
    *,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    scale: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """[b, h, sq, d] attention through ``F.scaled_dot_product_attention`` (differentiable, any device).

    ``mask`` may pass a precomputed ``allowed_mask(q_pos, k_pos, k_valid, window)`` (shared by all
    layers of one window size); ``sinks`` is [h] or None.
    """
    allowed = allowed_mask(q_pos, k_pos, k_valid, window) if mask is None else mask
    if sinks is None:
        has_key = allowed.any(-1, keepdim=True)  # [b, 1, sq, 1]
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed | ~has_key, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
        return out.masked_fill(~has_key, 0.0)
    b, h, sq, _ = q.shape
    if sinks.shape != (h,):
        raise ValueError(f"sinks must have shape ({h},) (one per query head), got {tuple(sinks.shape)}")
    hk = k.shape[1]
    zeros = k.new_zeros(b, hk, 1, k.shape[-1])
    k = torch.cat([k, zeros], dim=2)
    v = torch.cat([v, v.new_zeros(b, hk, 1, v.shape[-1])], dim=2)
    keys = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(~allowed, float("-inf"))
    keys = keys.expand(b, h, sq, -1)
    sink_col = sinks.to(q.dtype)[None, :, None, None].expand(b, h, sq, 1)
    attn_mask = torch.cat([keys, sink_col], dim=-1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale, enable_gqa=h != hk)


@functools.cache
def _compiled_flex() -> Callable:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    k_valid: torch.Tensor,
    *,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    scale: float,
    block_mask=None,
) -> torch.Tensor:
    """[b, h, sq, d] attention through FlexAttention (compiled on CUDA, eager and forward-only on CPU).

    ``block_mask`` may pass a precomputed ``flex_block_mask(q_pos, k_pos, k_valid, window)``.
    """
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    if block_mask is None:
        block_mask = flex_block_mask(q_pos, k_pos, k_valid, window)
    fn = _compiled_flex() if q.is_cuda else flex_attention
    gqa = q.shape[1] != k.shape[1]
    if sinks is None:
        return fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    h = q.shape[1]
    if sinks.shape != (h,):
        raise ValueError(f"sinks must have shape ({h},) (one per query head), got {tuple(sinks.shape)}")
    out, aux = fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa, return_aux=AuxRequest(lse=True))
    keep = torch.sigmoid(aux.lse.float() - sinks.float()[None, :, None])  # [b, h, sq]: Z / (Z + e^s)
    return (out.float() * keep[..., None]).to(q.dtype)


# ---- per-layer window and the AttentionContext adapters ----------------------------------------------


def layer_window(window_size: tuple[int, int] | None, window_attn_skip_freq, layer_number: int) -> int:
    """Our ``window`` for one layer from megatron-core's ``window_size`` / ``window_attn_skip_freq``.

    ``layer_number`` is 1-based (megatron-core's). ``window_size = (W - 1, 0)`` -> W; None or a
    layer the skip pattern makes full -> 0. Megatron-core's rule: skip_freq N makes every N-th layer
    full (GPT-OSS: N = 2, layers 1, 3, ... sliding, i.e. HF ``layer_types`` starting with
    ``sliding_attention``); a list gives 1 (sliding) / 0 (full) per layer.
    """
    if not window_size:
        return 0
    left, right = window_size
    if right != 0 or left < 0:
        raise ValueError(f"window_size={window_size!r}: only causal windows (W - 1, 0) are supported")
    if window_attn_skip_freq is None:
        sliding = True
    elif isinstance(window_attn_skip_freq, int):
        sliding = layer_number % window_attn_skip_freq != 0
    else:
        sliding = bool(window_attn_skip_freq[layer_number - 1])
    return left + 1 if sliding else 0


def context_mask(ctx, window: int) -> torch.Tensor:
    """``allowed_mask`` for an ``AttentionContext`` (gathered keys under CP), built once per microbatch."""

    def build():
        k_pos, k_valid = ctx.key_positions()
        return allowed_mask(ctx.positions, k_pos, k_valid, window)

    return ctx.cached(("allowed", window), build)


def context_block_mask(ctx, window: int, batch: int, sq: int, sk: int):
    """``flex_block_mask`` for an ``AttentionContext``, built once per microbatch and window."""

    def build():
        k_pos, k_valid = ctx.key_positions()
        return flex_block_mask(ctx.positions, k_pos, k_valid, window)

    return ctx.cached(("block_mask", window, batch, sq, sk), build)


def sdpa_kernel(q, k, v, ctx, scale: float, *, window: int = 0, sinks: torch.Tensor | None = None):
    """``backend.model.attention`` kernel signature plus ``window`` and ``sinks`` (padded or packed rows)."""
    if ctx.is_packed:
        from .packed_attention import sdpa_packed

        return sdpa_packed(q, k, v, ctx, scale, window=window, sinks=sinks)
    k_pos, k_valid = ctx.key_positions()
    return sdpa_sink_attention(
        q, k, v, ctx.positions, k_pos, k_valid, window=window, sinks=sinks, scale=scale, mask=context_mask(ctx, window)
    )


def flex_kernel(q, k, v, ctx, scale: float, *, window: int = 0, sinks: torch.Tensor | None = None):
    """``backend.model.attention`` kernel signature plus ``window`` and ``sinks`` (padded or packed rows)."""
    if ctx.is_packed:
        from .packed_attention import flex_packed_block_mask

        block_mask = flex_packed_block_mask(ctx, q, k, window)
    else:
        block_mask = context_block_mask(ctx, window, q.shape[0], q.shape[2], k.shape[2])
    return flex_sink_attention(
        q, k, v, None, None, None, window=window, sinks=sinks, scale=scale, block_mask=block_mask
    )


KERNELS = {"sdpa": sdpa_kernel, "flex": flex_kernel}
