"""The SDPA kernel (``F.scaled_dot_product_attention``): padded and packed rows, sliding windows and
learnable sinks; differentiable on every device, the CPU training path.

Shapes: q [b, h, sq, d], k / v [b, hk, sk, d] (grouped-query when hk < h; keys CP-gathered).

- **Padded rows, no window or sinks**: without CP (queries are the keys, each row right-padded)
  the causal kernel (``is_causal``): a real query's keys are its own row's earlier tokens, which
  the causal rule alone gives, padding coming after them; under CP (load-balanced chunks) one
  call with the microbatch's dense mask (``masks``).
- **Packed rows**: time and memory follow sum(l_i^2), never the row's square
  (``tools/bench/bench_packed_attention.py``). Without CP, window or sinks the sequences are
  batched by length (``causal_groups``): each group's sequences gathered into a [g, h, L, d]
  batch right-padded to its longest L, one causal call per group, the real outputs gathered back
  into row order, so a row of 64 rollouts takes one or a few calls, not 64 (the calls and their
  slices were 1,000 of the 2,800 operators of the tiny GRPO demo's training step, and 45 ms of a
  4-layer x 512 model's). Otherwise one call per sequence on views of q/k/v; under CP the keys
  are all-gathered once per layer and each sequence's real keys picked in position order with one
  ``index_select``.
- **Sinks** (GPT-OSS ``self_attn.sinks``, one logit s_h per head): an extra key every query sees,
  with logit s_h (not scaled) and a zero value, so ``out = sum_j e^{l_j} v_j / (e^{s_h} +
  sum_j e^{l_j})``. The sink is appended as one more key whose value row is 0, its logit carried by
  the additive float mask (s_h in the sink column, 0 / -inf elsewhere), which SDPA differentiates:
  the sinks get their gradients. The mask is materialised per head, [b, h, sq, sk + 1] in the
  compute dtype (the price of exactness on SDPA).
- Rows with no allowed key and no sink (padding queries far past a row's end under a window, an
  empty row) get an arbitrary finite row and a zero output, so no NaN reaches the backward pass.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .context import AttentionContext
from .layout import packed_real_key_index
from .masks import allowed_mask, dense_mask


def sdpa_sink_attention(q, k, v, allowed: torch.Tensor, *, sinks: torch.Tensor | None = None, scale: float):
    """[b, h, sq, d] attention where ``allowed`` [b, 1, sq, sk] (``masks``) is True, with optional
    ``sinks`` [h]; rows with no allowed key give zeros."""
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


def sdpa_attention(
    q, k, v, ctx: AttentionContext, scale: float, *, window: int = 0, sinks: torch.Tensor | None = None
) -> torch.Tensor:
    """The kernel: q [b, h, sq, d], k / v [b, hk, sk, d] (CP-gathered) -> [b, h, sq, d]."""
    if ctx.is_packed:
        return sdpa_packed(q, k, v, ctx, scale, window=window, sinks=sinks)
    if not window and sinks is None:
        if CAUSAL_FAST_PATHS and ctx.cp_size == 1 and q.shape[2] == k.shape[2]:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask(ctx), scale=scale, enable_gqa=True)
    return sdpa_sink_attention(q, k, v, dense_mask(ctx, window), sinks=sinks, scale=scale)


# ---- packed rows: one call per sequence -------------------------------------------------------------


def _sdpa_plan(ctx: AttentionContext, device) -> list[tuple]:
    """Per sequence: (q_start, q_end, k_start, k_end, mask or None) over local queries and the
    selected real keys; built once per microbatch."""

    def build():
        lengths, segments = ctx.segments()
        cp = ctx.cp_size
        out, q_off, k_off = [], 0, 0
        for n, seg in zip(lengths, segments):
            local = seg // cp
            if cp == 1:  # keys are the local row itself; padding queries get zeros
                out.append((q_off, q_off + n, q_off, q_off + n, None))
            else:
                qpos = ctx.positions[0, q_off : q_off + local]
                mask = torch.arange(n, device=device)[None, :] <= qpos[:, None]
                out.append((q_off, q_off + local, k_off, k_off + n, mask[None, None]))
            q_off += local
            k_off += n
        return out

    return ctx.cached("sdpa_packed_plan", build)


#: The causal kernel for right-padded rows and length-batched packed sequences (above). False
#: takes the dense mask and one call per sequence everywhere, the paths before them (the same
#: numbers to FP32 rounding): kept so a comparison can pin the earlier kernels.
CAUSAL_FAST_PATHS = True

#: A group's padded area g x L^2 may exceed its sequences' sum(l_i^2) by this factor, or by
#: ``GROUP_SLACK_AREA`` scores a head (a call's fixed cost is worth some padding), before the
#: next, shorter sequence starts a new group.
GROUP_SLACK_FACTOR = 1.25
GROUP_SLACK_AREA = 32768


def causal_groups(lengths: list[int], starts: list[int], row: int) -> tuple[list[tuple], list[int]]:
    """Sequences of a packed row batched by length for the causal kernel (pure arithmetic).

    ``lengths`` / ``starts``: each sequence's real tokens and first place in the row of ``row``
    places (a sequence of no token is left out). Returns the groups, each (g, L, gather, real):
    ``gather`` the g x L row places to read (a sequence's places, then its last real place
    repeated as padding), ``real`` the
    places of that [g x L] batch holding real tokens (in order); and ``order``, for each row
    place, its index in the concatenation of every group's real outputs followed by one zero
    (places no sequence covers: padding)."""
    by_length = sorted((i for i in range(len(lengths)) if lengths[i] > 0), key=lambda i: -lengths[i])
    groups, current, squares = [], [], 0
    for i in by_length:
        n = lengths[i]
        if current:
            longest = lengths[current[0]]
            area, exact = (len(current) + 1) * longest * longest, squares + n * n
            if area > GROUP_SLACK_FACTOR * exact and area - exact > GROUP_SLACK_AREA:
                groups.append(current)
                current, squares = [], 0
        current.append(i)
        squares += n * n
    if current:
        groups.append(current)
    out, source, done = [], {}, 0
    for members in groups:
        longest = lengths[members[0]]
        gather, real = [], []
        for slot, i in enumerate(members):
            start, n = starts[i], lengths[i]
            gather += [start + t for t in range(n)] + [start + n - 1] * (longest - n)
            real += [slot * longest + t for t in range(n)]
            for t in range(n):
                source[start + t] = done + t
            done += n
        out.append((len(members), longest, gather, real))
    return out, [source.get(place, done) for place in range(row)]


def _grouped_plan(ctx: AttentionContext, device) -> tuple[list[tuple], torch.Tensor]:
    """``causal_groups`` of the microbatch's packed row (CP 1) as index tensors, built once."""

    def build():
        lengths, _ = ctx.segments()
        starts = ctx.cu_seqlens_padded.tolist()[:-1]  # each sequence's first place in the row (CP 1)
        groups, order = causal_groups(lengths, starts, ctx.positions.shape[1])
        as_index = functools.partial(torch.tensor, dtype=torch.long, device=device)
        return [(g, n, as_index(gather), as_index(real)) for g, n, gather, real in groups], as_index(order)

    return ctx.cached("sdpa_causal_groups", build)


def sdpa_grouped(q, k, v, ctx: AttentionContext, scale: float) -> torch.Tensor:
    """A packed row's causal attention, its sequences batched by length (``causal_groups``):
    q [1, h, s, d], k / v [1, hk, s, d] (CP 1) -> [1, h, s, d]. Padding places read a real token
    and come after every real one in their sequence, so the causal rule keeps them out of every
    real query's keys, and their outputs are never read back: gradients are those of the
    per-sequence calls (FP32 rounding aside: the kernel tiles a longer batch differently)."""
    groups, order = _grouped_plan(ctx, q.device)
    h, d = q.shape[1], q.shape[3]
    outs = []
    for g, n, gather, real in groups:
        qg, kg, vg = (x[0].index_select(1, gather).unflatten(1, (g, n)).transpose(0, 1) for x in (q, k, v))
        out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, scale=scale, enable_gqa=True)
        outs.append(out.transpose(0, 1).reshape(h, g * n, d).index_select(1, real))
    outs.append(q.new_zeros(h, 1, d))
    return torch.cat(outs, dim=1).index_select(1, order)[None]


def packed_keys(k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext) -> tuple[torch.Tensor, torch.Tensor]:
    """[1, h, sum(l_i), d]: every sequence's real keys and values in position order, picked from
    the CP-gathered rows ``k`` and ``v`` with one index_select (used under CP only)."""
    lengths, segments = ctx.segments()
    index = ctx.cached(
        "packed_key_index",
        lambda: torch.tensor(packed_real_key_index(lengths, segments, ctx.cp_size), device=k.device),
    )
    return k.index_select(2, index), v.index_select(2, index)


def _sequence_mask(ctx: AttentionContext, q0: int, q1: int, n: int, window: int) -> torch.Tensor:
    """[1, 1, q1 - q0, n] allowed mask of one packed sequence: its local queries (global in-sequence
    positions) against its n real keys at positions 0..n-1."""
    q_pos = ctx.positions[:, q0:q1]
    k_pos = torch.arange(n, device=q_pos.device)[None]
    return allowed_mask(q_pos, k_pos, torch.ones_like(k_pos, dtype=torch.bool), window)


def sdpa_packed(q, k, v, ctx: AttentionContext, scale: float, *, window: int = 0, sinks=None) -> torch.Tensor:
    """q [1, h, s_local, d]; k, v [1, hk, s_keys, d] (CP-gathered under CP) -> [1, h, s_local, d].

    With a sliding ``window`` or ``sinks`` each sequence runs ``sdpa_sink_attention`` on its own
    positions (keys at 0..l-1), so windows are on in-sequence positions and every sequence sees
    the sink, as in the padded layout."""
    plain = not window and sinks is None
    if CAUSAL_FAST_PATHS and plain and ctx.cp_size == 1 and len(ctx.segments()[0]) > 1:
        return sdpa_grouped(q, k, v, ctx, scale)
    if ctx.cp_size > 1:
        k, v = packed_keys(k, v, ctx)
    pieces, done = [], 0
    for i, (q0, q1, k0, k1, mask) in enumerate(_sdpa_plan(ctx, q.device)):
        if q0 > done:
            pieces.append(q.new_zeros(q.shape[0], q.shape[1], q0 - done, q.shape[3]))
        qs, ks, vs = q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1]
        if not plain:
            build = functools.partial(_sequence_mask, ctx, q0, q1, k1 - k0, window)
            seq_mask = ctx.cached(("packed_allowed", window, i), build)
            pieces.append(sdpa_sink_attention(qs, ks, vs, seq_mask, sinks=sinks, scale=scale))
        elif mask is None:
            pieces.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True))
        else:
            pieces.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True))
        done = q1
    if done < q.shape[2]:
        pieces.append(q.new_zeros(q.shape[0], q.shape[1], q.shape[2] - done, q.shape[3]))
    return torch.cat(pieces, dim=2)
