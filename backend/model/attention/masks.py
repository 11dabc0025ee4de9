"""Which keys a query may attend: the rule stated once, turned into a dense mask (SDPA) or a
FlexAttention ``mask_mod`` / ``BlockMask``, each built once per microbatch and window.

A query at global position p may attend a key at position j iff

- j <= p (causal on global positions, so a CP rank's two chunks and keys gathered in any order
  need no special case),
- the key is valid (not right padding),
- with a sliding ``window`` W > 0: p - W < j, the W most recent positions, itself included
  (transformers' ``sliding_window = W``, megatron-core / Transformer Engine's
  ``window_size = (W - 1, 0)``); ``window = 0`` is full causal,
- in a packed row, the key belongs to the query's own sequence (positions restart at 0 per
  sequence, so the window and causality are in-sequence).

The predicate works on broadcast tensors (dense masks) and on the scalar index tensors a
``mask_mod`` receives alike, so both forms cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .context import AttentionContext


def allowed(q_pos, k_pos, k_valid, window: int = 0, q_seg=None, k_seg=None):
    """True where a query may attend a key (the rule above); arguments broadcast together."""
    ok = (k_pos <= q_pos) & k_valid
    if window:
        ok = ok & (k_pos > q_pos - window)
    if q_seg is not None:
        ok = ok & (k_seg == q_seg)
    return ok


def allowed_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, k_valid: torch.Tensor, window: int = 0) -> torch.Tensor:
    """[b, 1, sq, sk] bool from q_pos [b, sq], k_pos / k_valid [b, sk]."""
    if window < 0:
        raise ValueError(f"window must be 0 (full) or positive, got {window}")
    return allowed(q_pos[:, :, None], k_pos[:, None, :], k_valid[:, None, :], window)[:, None]


def mask_mod(q_pos, k_pos, k_valid, window: int = 0, q_seg=None, k_seg=None) -> Callable:
    """The FlexAttention ``mask_mod`` of the rule (indices into the local rows: q_pos [b, sq],
    k_pos / k_valid [b, sk], segment ids likewise or None)."""

    def mod(b, h, q_idx, kv_idx):
        qs = None if q_seg is None else q_seg[b, q_idx]
        ks = None if k_seg is None else k_seg[b, kv_idx]
        return allowed(q_pos[b, q_idx], k_pos[b, kv_idx], k_valid[b, kv_idx], window, qs, ks)

    return mod


def flex_block_mask(q_pos, k_pos, k_valid, window: int = 0, *, q_seg=None, k_seg=None, block_size: int = 128):
    """A ``BlockMask`` of the rule: blocks all in the future, all padding, outside the window or of
    another sequence are skipped entirely."""
    from torch.nn.attention.flex_attention import create_block_mask

    b, sq, sk = q_pos.shape[0], q_pos.shape[1], k_pos.shape[1]
    mod = mask_mod(q_pos, k_pos, k_valid, window, q_seg, k_seg)
    return create_block_mask(mod, b, None, sq, sk, device=q_pos.device, BLOCK_SIZE=block_size)


def _segments(ctx: AttentionContext) -> tuple:
    return (ctx.segment_ids, ctx.key_segment_ids()) if ctx.is_packed else (None, None)


def dense_mask(ctx: AttentionContext, window: int = 0) -> torch.Tensor:
    """[b, 1, s_q, s_keys] bool mask of a microbatch (keys CP-gathered), built once per window."""

    def build():
        k_pos, k_valid = ctx.key_positions()
        q_seg, k_seg = _segments(ctx)
        if q_seg is not None:
            q_seg, k_seg = q_seg[:, :, None], k_seg[:, None, :]
        return allowed(ctx.positions[:, :, None], k_pos[:, None, :], k_valid[:, None, :], window, q_seg, k_seg)[:, None]

    return ctx.cached(("dense", window), build)


def block_mask(ctx: AttentionContext, window: int = 0):
    """The microbatch's ``BlockMask`` (document mask for packed rows), built once per window."""

    def build():
        k_pos, k_valid = ctx.key_positions()
        q_seg, k_seg = _segments(ctx)
        return flex_block_mask(ctx.positions, k_pos, k_valid, window, q_seg=q_seg, k_seg=k_seg)

    return ctx.cached(("block_mask", window), build)
