"""The Transformer Engine kernel (GPU): THD for packed rows, ``padding_causal`` for padded ones,
never the arbitrary-mask unfused fallback; the TE import stays inside the factory.

- Packed rows: ``qkv_format="thd"`` with cu_seqlens and cu_seqlens_padded, and Transformer
  Engine's own CP for THD (``p2p``, or ``a2a`` with windows / sinks).
- Padded rows: ``padding_causal`` with the sequence lengths at CP 1 and, under CP, two calls per
  layer: one per local query chunk, causal bottom-right over the gathered keys up to that chunk's
  end (``layout.te_padded_cp_chunks``).
- GPT-OSS windows and sinks go to TE itself: ``window_size=(W - 1, 0)`` (bottom-right aligned in
  the padded CP calls, which is exactly "the W positions up to the query's own", since each
  call's last real query meets its last real key) and ``softmax_type="learnable"`` reading the
  core attention's sinks (``te_lend_sinks``). What TE needs for them (read from its sources, 2.8
  .. 2.18): sinks run on FusedAttention only (cuDNN >= 9.13.1, BF16/FP16; FP32 falls back to the
  unfused kernel, padded rows only), THD rows with sinks need TE >= 2.12 and cuDNN >= 9.18, and
  TE's CP takes windows and sinks only over ``a2a`` (TE >= 2.10 for THD; ``te_packed_refusal``
  stops a run that lacks them at the first packed call).

The pure pieces (keyword arguments, CP exchange, refusals, the sinks' gradient scale) are tested
on CPU; the TE calls themselves are GPU code, tested by tests/gpu when Transformer Engine imports.
"""

from __future__ import annotations

import torch

from .cp import gather_cp
from .layout import cumulative, te_global_order_index, te_padded_cp_chunks


def te_attention_kwargs(num_kv: int, scale: float, *, window: int, sinks: bool, accepted: set[str]) -> dict:
    """``te.DotProductAttention`` keyword arguments for one layer (pure; tested on CPU).

    ``window`` W > 0 -> ``window_size=(W - 1, 0)`` (the same W most recent positions as
    ``masks``); ``sinks`` -> ``softmax_type="learnable"`` (Transformer Engine >= 2.8, whose
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
        cp = ctx.cp_size
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
        lengths, segments = ctx.segments()
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
        lengths = ctx.valid.sum(dim=1).tolist() if ctx.cp_size == 1 else None
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

        cp, rank = ctx.cp_size, dist.get_rank(ctx.cp_group)
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
        te_lend_sinks(modules["cp"], te_cp_sinks(sinks, ctx.cp_size))
        try:
            return packed(q, k, v, ctx) if ctx.is_packed else padded(q, k, v, ctx)
        finally:  # TE's autograd saved what it needs; the modules keep no reference
            for module in modules.values():
                te_lend_sinks(module, None)

    kernel.local_kv = True
    return modules, kernel
