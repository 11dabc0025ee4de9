"""Attention over packed rows (one row, many sequences) and Transformer Engine's fast paths.

A packed microbatch is one row of n sequences back to back; sequence i occupies
[cu_seqlens_padded[i], cu_seqlens_padded[i+1]) of the row (global offsets, before the CP cut),
its first cu_seqlens[i+1] - cu_seqlens[i] tokens real. Positions restart at 0 per sequence and a
query attends only keys of its own sequence at positions <= its own. Under CP size c every
sequence is cut into 2c chunks and CP rank r holds chunks r and 2c-1-r of EVERY sequence, so the
local row holds sequence i at [cu_seqlens_padded[i] / c, cu_seqlens_padded[i+1] / c).

Each backend pays only for same-sequence pairs:

- sdpa: one SDPA call per sequence on views of q/k/v (no (total x total) mask: time and memory
  scale with sum(l_i^2), not the row's square). Under CP the keys are all-gathered once per layer
  and the real keys of each sequence selected in global order (one index_select).
- flex: a document mask (same sequence, causal on positions, real keys), whose BlockMask skips
  every cross-sequence block; built once per microbatch through ``AttentionContext.cached``.
- te: ``qkv_format="thd"`` with cu_seqlens and cu_seqlens_padded (Transformer Engine's own CP for
  THD). Padded microbatches run ``padding_causal`` with sequence lengths at CP 1 and, under CP,
  two calls per layer: one per local query chunk, causal bottom-right over the gathered keys up to
  that chunk's end. No arbitrary mask, so the fused kernels run (the unfused fallback never does).

GPT-OSS sliding windows and sinks (``sinks_windows``) hold per sequence: sdpa runs
``sdpa_sink_attention`` on each sequence with its in-sequence positions, flex adds the window to
the document mask and the sinks through the log-sum-exp. te passes them to Transformer Engine:
``window_size=(W - 1, 0)`` (bottom-right aligned in the padded CP calls, which is exactly "the W
positions up to the query's own", since each call's last real query meets its last real key) and
``softmax_type="learnable"`` reading the core attention's sinks (``te_lend_sinks``). What TE
needs for them (read from its sources, 2.8 .. 2.18): sinks run on FusedAttention only (cuDNN
>= 9.13.1, BF16/FP16; FP32 falls back to the unfused kernel, padded rows only), THD rows with sinks
need TE >= 2.12 and cuDNN >= 9.18, and TE's CP takes windows and sinks only over ``a2a`` (TE >= 2.10 for THD;
``te_packed_refusal`` stops a run that lacks them at the first packed call).

The index arithmetic lives in small pure functions (``te_padded_cp_chunks``, ``gathered_to_global``,
``packed_real_key_index``), tested on CPU against the SDPA masks; the TE calls themselves are
marked GPU code and tested by tests/gpu when Transformer Engine imports.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from backend.batching import cp_ranges

from . import sinks_windows


def _cp_size(ctx) -> int:
    import torch.distributed as dist

    return dist.get_world_size(ctx.cp_group) if ctx.cp_group is not None else 1


def segments_of(ctx) -> tuple[list[int], list[int]]:
    """(real lengths, padded lengths) of the packed row's sequences, as Python ints (cached)."""

    def build():
        cu = ctx.cu_seqlens.tolist()
        cu_pad = ctx.cu_seqlens_padded.tolist()
        return [b - a for a, b in zip(cu, cu[1:])], [b - a for a, b in zip(cu_pad, cu_pad[1:])]

    return ctx.cached("segments", build)


def gathered_to_global(segments: list[int], cp_size: int) -> list[int]:
    """For each token of the CP-gathered packed row (CP ranks' local rows concatenated in rank
    order), its offset in the global row."""
    out: list[int] = []
    for rank in range(cp_size):
        for start, end in cp_ranges(segments, cp_size, rank):
            out.extend(range(start, end))
    return out


def packed_real_key_index(seq_lengths: list[int], segments: list[int], cp_size: int) -> list[int]:
    """Indices into the CP-gathered row of every sequence's real tokens, sequence after sequence,
    in position order (sequence i's keys then sit at cu_seqlens[i]:cu_seqlens[i+1])."""
    inverse = [0] * sum(segments)
    for gathered, global_offset in enumerate(gathered_to_global(segments, cp_size)):
        inverse[global_offset] = gathered
    out, offset = [], 0
    for n, seg in zip(seq_lengths, segments):
        out.extend(inverse[offset : offset + n])
        offset += seg
    return out


def _sdpa_plan(ctx, device) -> list[tuple]:
    """Per sequence: (q_start, q_end, k_start, k_end, mask or None) over local queries and the
    selected real keys; built once per microbatch."""

    def build():
        lengths, segments = segments_of(ctx)
        cp = _cp_size(ctx)
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


def packed_keys(k: torch.Tensor, v: torch.Tensor, ctx) -> tuple[torch.Tensor, torch.Tensor]:
    """[1, h, sum(l_i), d]: every sequence's real keys and values in position order, picked from
    the CP-gathered rows ``k`` and ``v`` with one index_select (used under CP only)."""
    lengths, segments = segments_of(ctx)
    index = ctx.cached(
        "packed_key_index",
        lambda: torch.tensor(packed_real_key_index(lengths, segments, _cp_size(ctx)), device=k.device),
    )
    return k.index_select(2, index), v.index_select(2, index)


def sdpa_packed(q, k, v, ctx, scale: float, *, window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [1, h, s_local, d]; k, v [1, hk, s_keys, d] (CP-gathered under CP) -> [1, h, s_local, d].

    With a sliding ``window`` or ``sinks`` (GPT-OSS) each sequence runs
    ``sinks_windows.sdpa_sink_attention`` on its own positions (keys at 0..l-1), so windows are
    on in-sequence positions and every sequence sees the sink, as in the padded layout."""
    cp = _cp_size(ctx)
    if cp > 1:
        k, v = packed_keys(k, v, ctx)
    plain = not window and sinks is None
    pieces, done = [], 0
    for i, (q0, q1, k0, k1, mask) in enumerate(_sdpa_plan(ctx, q.device)):
        if q0 > done:
            pieces.append(q.new_zeros(q.shape[0], q.shape[1], q0 - done, q.shape[3]))
        qs, ks, vs = q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1]
        if not plain:
            build = functools.partial(_sequence_mask, ctx, q0, q1, k1 - k0, window)
            allowed = ctx.cached(("packed_allowed", window, i), build)
            pieces.append(
                sinks_windows.sdpa_sink_attention(
                    qs, ks, vs, None, None, None, window=window, sinks=sinks, scale=scale, mask=allowed
                )
            )
        elif mask is None:
            pieces.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True))
        else:
            pieces.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True))
        done = q1
    if done < q.shape[2]:
        pieces.append(q.new_zeros(q.shape[0], q.shape[1], q.shape[2] - done, q.shape[3]))
    return torch.cat(pieces, dim=2)


def _sequence_mask(ctx, q0: int, q1: int, n: int, window: int) -> torch.Tensor:
    """[1, 1, q1 - q0, n] allowed mask of one packed sequence: its local queries (global in-sequence
    positions) against its n real keys at positions 0..n-1."""
    q_pos = ctx.positions[:, q0:q1]
    k_pos = torch.arange(n, device=q_pos.device)[None]
    return sinks_windows.allowed_mask(q_pos, k_pos, torch.ones_like(k_pos, dtype=torch.bool), window)


def packed_dense_mask(ctx) -> torch.Tensor:
    """[1, 1, s_local, s_keys] bool document mask (same sequence, causal, real keys): the
    reference the per-sequence paths are tested against, and the flex mask's definition."""
    kpos, kvalid = ctx.key_positions()
    kseg = key_segment_ids(ctx)
    qseg, qpos = ctx.segment_ids, ctx.positions
    allowed = (kseg[:, None, :] == qseg[:, :, None]) & (kpos[:, None, :] <= qpos[:, :, None]) & kvalid[:, None, :]
    return allowed[:, None]


def key_segment_ids(ctx) -> torch.Tensor:
    """[1, s_keys] sequence id of every key: this rank's, or the CP group's gathered (rank order)."""

    def build():
        from .attention import _gather_plain

        seg = ctx.segment_ids
        if _cp_size(ctx) > 1:
            seg = _gather_plain(seg.t().contiguous(), ctx.cp_group).t()
        return seg

    return ctx.cached("key_segments", build)


def flex_packed_block_mask(ctx, q, k, window: int = 0):
    """The document BlockMask (cross-sequence blocks skipped; with ``window`` > 0 only the last
    ``window`` positions of the query's own sequence), built once per microbatch and window."""
    from torch.nn.attention.flex_attention import create_block_mask

    def build():
        kpos, kvalid = ctx.key_positions()
        kseg = key_segment_ids(ctx)
        qpos, qseg = ctx.positions, ctx.segment_ids

        def mask_mod(b, h, q_idx, kv_idx):
            same = (kseg[b, kv_idx] == qseg[b, q_idx]) & (kpos[b, kv_idx] <= qpos[b, q_idx]) & kvalid[b, kv_idx]
            if window:
                same = same & (kpos[b, kv_idx] > qpos[b, q_idx] - window)
            return same

        return create_block_mask(mask_mod, q.shape[0], None, q.shape[2], k.shape[2], device=q.device, BLOCK_SIZE=128)

    return ctx.cached(("block_mask", window), build)


# ---- Transformer Engine (GPU) -----------------------------------------------------------------


def te_padded_cp_chunks(seq_lengths: list[int], padded_len: int, cp_size: int, cp_rank: int) -> list[dict]:
    """The two TE calls of a padded microbatch under CP, as plain numbers (tested on CPU).

    Rank r holds query chunks r and 2c-1-r (chunk length C = padded_len / 2c) of every row. The
    call for chunk j takes queries [j*C, (j+1)*C) and the gathered keys [0, (j+1)*C) in global
    order, causal bottom-right: query t of the chunk sees keys up to j*C + t. Per row, q_lens are
    the real queries in the chunk (at least 1: a chunk of padding still runs one query, whose
    output no loss reads) and kv_lens the real keys up to the chunk's end.
    """
    chunk = padded_len // (2 * cp_size)
    out = []
    for half, j in enumerate((cp_rank, 2 * cp_size - 1 - cp_rank)):
        q_lens = [max(1, min(chunk, n - j * chunk)) for n in seq_lengths]
        kv_lens = [min(n, (j + 1) * chunk) for n in seq_lengths]
        kv_lens = [max(k, q) for k, q in zip(kv_lens, q_lens)]  # bottom-right needs kv >= q
        out.append(
            {
                "local_slice": (half * chunk, (half + 1) * chunk),
                "chunk_index": j,
                "kv_end": (j + 1) * chunk,
                "q_lens": q_lens,
                "kv_lens": kv_lens,
            }
        )
    return out


def te_global_order_index(padded_len: int, cp_size: int) -> list[int]:
    """Indices into a CP-gathered padded row (rank order) that put its tokens in global order."""
    gathered = gathered_to_global([padded_len], cp_size)
    inverse = [0] * padded_len
    for i, g in enumerate(gathered):
        inverse[g] = i
    return inverse


def cumulative(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def te_attention_kwargs(num_kv: int, scale: float, *, window: int, sinks: bool, accepted: set[str]) -> dict:
    """``te.DotProductAttention`` keyword arguments for one layer (pure; tested on CPU).

    ``window`` W > 0 -> ``window_size=(W - 1, 0)`` (the same W most recent positions as
    ``sinks_windows``); ``sinks`` -> ``softmax_type="learnable"`` (Transformer Engine >= 2.8, whose
    constructor is the first to take it: ``accepted`` is the constructor's parameter names).
    """
    kwargs = dict(
        num_gqa_groups=num_kv,
        attention_dropout=0.0,
        qkv_format="bshd",
        attn_mask_type="padding_causal",
        softmax_scale=scale,
    )
    if window:
        kwargs["window_size"] = (window - 1, 0)
    if sinks:
        if "softmax_type" not in accepted:
            raise RuntimeError(
                "model.attention_sinks with model.attention_backend=te needs Transformer Engine >= 2.8 "
                "(DotProductAttention(softmax_type='learnable')); use flex, or upgrade Transformer Engine"
            )
        kwargs["softmax_type"] = "learnable"
    return kwargs


def te_cp_comm_type(*, window: int, sinks: bool, num_heads: int, num_kv: int, cp_size: int) -> str:
    """Transformer Engine's CP exchange for packed (THD) rows: ``p2p`` (a ring), except that TE
    runs sliding windows only with ``a2a`` / ``all_gather`` and sink softmax only with ``a2a``
    (which scatters heads, so both head counts must divide by the CP size)."""
    if not window and not sinks:
        return "p2p"
    if num_heads % cp_size or num_kv % cp_size:
        raise RuntimeError(
            f"model.attention_backend=te with sinks/windows on packed rows under context parallelism uses "
            f"Transformer Engine's a2a exchange, which needs the head counts ({num_heads} query, {num_kv} "
            f"key/value) divisible by parallel.context_parallel_size={cp_size}; use flex or the padded layout"
        )
    return "a2a"


def te_packed_refusal(te_version: str, *, window: int, sinks: bool, cp_size: int, dtype: torch.dtype) -> str | None:
    """Why this Transformer Engine cannot run GPT-OSS attention on packed (THD) rows, or None.

    Read from TE's sources (2.8 .. 2.18): THD with sinks runs on FusedAttention from TE 2.12 only,
    and only in BF16/FP16 (FP32 goes to the unfused kernel, which has no THD); TE's CP exchanges
    THD rows with windows or sinks over ``a2a`` from TE 2.10. Checked at the first packed call, so
    a run stops with the keys to change instead of inside TE."""
    from packaging.version import Version

    version = Version(te_version.split("+")[0])
    fix = "use model.attention_backend=flex or train.dynamic_batch_layout=padded"
    if sinks and version < Version("2.12"):
        return (
            f"model.attention_sinks on packed rows with te needs Transformer Engine >= 2.12 (have {te_version}); {fix}"
        )
    if sinks and dtype not in (torch.bfloat16, torch.float16):
        return f"model.attention_sinks on packed rows with te runs in BF16/FP16 only (have {dtype}); {fix}"
    if cp_size > 1 and (window or sinks) and version < Version("2.10"):
        return (
            f"sinks/windows on packed rows with te under context parallelism need Transformer Engine >= 2.10 "
            f"(its a2a exchange for THD; have {te_version}); {fix}"
        )
    return None


def te_lend_sinks(module: torch.nn.Module, sinks: torch.Tensor | None) -> None:
    """Make a TE ``DotProductAttention(softmax_type="learnable")`` read ``sinks`` as its offset.

    TE registers its own ``softmax_offset`` parameter (uninitialised before TE 2.14) and reads
    ``self.softmax_offset`` in forward (no forward argument). The sinks are ours: the core
    attention's ``softmax_offset`` (the checkpoint's and Hugging Face's ``sinks``). So TE's
    parameter is dropped as soon as the module is built (``sinks=None``: before FSDP2, the
    optimizer or a checkpoint can see it), and around each call the tensor the core attention
    holds *now* (FSDP2 swaps sharded and unsharded parameters between calls, so no reference is
    kept) is put in the module's instance dict, where attribute lookup finds it before
    ``Module.__getattr__``.
    """
    module._parameters.pop("softmax_offset", None)
    module.__dict__["softmax_offset"] = sinks


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times ``factor`` on the way back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


def te_cp_sinks(sinks: torch.Tensor, cp_size: int) -> torch.Tensor:
    """The sinks as TE's a2a CP exchange should see them.

    Under a2a every CP rank attends over whole sequences for a slice of the heads, and TE
    all-gathers the sinks' gradient over the CP group, so each rank ends up holding the complete
    gradient (TE's own CP test compares it to the no-CP one). Every other parameter's gradient on a
    CP rank is its chunk's share, summed over the CP ranks by the data-parallel reduction; summed
    there, the sinks' would be ``cp_size`` times too large. Hence a gradient scaled by 1/cp."""
    return sinks if cp_size == 1 else _ScaleGrad.apply(sinks, 1.0 / cp_size)


def te_kernel_factory(
    num_heads: int, num_kv: int, head_dim: int, scale: float, *, window: int = 0, sinks: bool = False
):  # pragma: no cover - GPU
    """A TE kernel for padded and packed microbatches. Returns (modules to register, kernel);
    the kernel takes LOCAL keys and values (``kernel.local_kv``): it gathers what it needs.
    GPT-OSS: ``window`` (0 = full) and ``sinks`` (the kernel then takes ``sinks=`` per call)."""
    import inspect

    import transformer_engine.pytorch as te

    from .attention import gather_cp

    accepted = set(inspect.signature(te.DotProductAttention.__init__).parameters)
    kwargs = te_attention_kwargs(num_kv, scale, window=window, sinks=sinks, accepted=accepted)

    def make():
        module = te.DotProductAttention(num_heads, head_dim, **kwargs)
        if sinks:  # TE's own offset goes before anything (FSDP2, checkpoints) can see it
            te_lend_sinks(module, None)
        return module

    modules = torch.nn.ModuleDict({"local": make(), "cp": make()})
    state = {"cp_group": None}

    def int32(values, device):
        return torch.tensor(values, dtype=torch.int32, device=device)

    def packed(q, k, v, ctx):
        # THD: [t, h, d] local tokens; cu_seqlens are the global (pre-CP-cut) ones, TE divides.
        cp = _cp_size(ctx)
        if window or sinks:
            refusal = te_packed_refusal(te.__version__, window=window, sinks=sinks, cp_size=cp, dtype=q.dtype)
            if refusal:
                raise RuntimeError(refusal)
        attn = modules["local"]
        if cp > 1:
            import torch.distributed as dist

            attn = modules["cp"]
            if state["cp_group"] is not ctx.cp_group:
                ranks = dist.get_process_group_ranks(ctx.cp_group)
                comm = te_cp_comm_type(window=window, sinks=sinks, num_heads=num_heads, num_kv=num_kv, cp_size=cp)
                attn.set_context_parallel_group(ctx.cp_group, ranks, torch.cuda.Stream(), comm)
                state["cp_group"] = ctx.cp_group
        lengths, segments = segments_of(ctx)
        t = q.shape[2]
        thd = [x[0].transpose(0, 1).contiguous() for x in (q, k, v)]
        out = attn(
            *thd,
            qkv_format="thd",
            attn_mask_type="padding_causal",
            cu_seqlens_q=ctx.cu_seqlens.to(q.device, torch.int32),
            cu_seqlens_kv=ctx.cu_seqlens.to(q.device, torch.int32),
            cu_seqlens_q_padded=ctx.cu_seqlens_padded.to(q.device, torch.int32),
            cu_seqlens_kv_padded=ctx.cu_seqlens_padded.to(q.device, torch.int32),
            max_seqlen_q=max(segments),
            max_seqlen_kv=max(segments),
        )
        return out.view(t, num_heads, head_dim).transpose(0, 1).unsqueeze(0)

    def padded(q, k, v, ctx):
        b, _, s, _ = q.shape
        lengths = ctx.valid.sum(dim=1).tolist() if _cp_size(ctx) == 1 else None
        attn = modules["local"]
        bshd = [x.transpose(1, 2) for x in (q, k, v)]
        if lengths is not None:  # CP 1: padding_causal with the sequence lengths
            cu = int32(cumulative(lengths), q.device)
            out = attn(
                *bshd,
                attn_mask_type="padding_causal",
                cu_seqlens_q=cu,
                cu_seqlens_kv=cu,
                max_seqlen_q=s,
                max_seqlen_kv=s,
            )
            return out.view(b, s, num_heads, head_dim).transpose(1, 2)
        import torch.distributed as dist

        cp, rank = _cp_size(ctx), dist.get_rank(ctx.cp_group)
        padded_len = s * cp
        kpos, kvalid = ctx.key_positions()
        seq_lengths = kvalid.sum(dim=1).tolist()
        order = ctx.cached("te_order", lambda: torch.tensor(te_global_order_index(padded_len, cp), device=q.device))
        kg = gather_cp(bshd[1].transpose(0, 1), ctx.cp_group).transpose(0, 1).index_select(1, order)
        vg = gather_cp(bshd[2].transpose(0, 1), ctx.cp_group).transpose(0, 1).index_select(1, order)
        outs = []
        for call in te_padded_cp_chunks(seq_lengths, padded_len, cp, rank):
            a, e = call["local_slice"]
            out = attn(
                bshd[0][:, a:e].contiguous(),
                kg[:, : call["kv_end"]].contiguous(),
                vg[:, : call["kv_end"]].contiguous(),
                attn_mask_type="padding_causal_bottom_right",
                cu_seqlens_q=int32(cumulative(call["q_lens"]), q.device),
                cu_seqlens_kv=int32(cumulative(call["kv_lens"]), q.device),
                max_seqlen_q=e - a,
                max_seqlen_kv=call["kv_end"],
            )
            outs.append(out.view(b, e - a, num_heads, head_dim))
        return torch.cat(outs, dim=1).transpose(1, 2)

    def kernel(q, k, v, ctx, _scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
        if sinks is None:
            return packed(q, k, v, ctx) if ctx.is_packed else padded(q, k, v, ctx)
        te_lend_sinks(modules["local"], sinks)
        te_lend_sinks(modules["cp"], te_cp_sinks(sinks, _cp_size(ctx)))
        try:
            return packed(q, k, v, ctx) if ctx.is_packed else padded(q, k, v, ctx)
        finally:  # TE's autograd saved what it needs; the modules keep no reference
            for module in modules.values():
                te_lend_sinks(module, None)

    kernel.local_kv = True
    return modules, kernel
