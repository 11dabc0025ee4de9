"""The output layer without whole logits: per-token log-probabilities and entropy, chunk by chunk.

A microbatch of N tokens with a V-token vocabulary holds N x V logits: on Qwen3's 151,936 ids that
is 608 KB a token in FP32, before the softmax an entropy needs and the logits' gradient (about
1.5 MB a token on Qwen3-4B, against about 0.2 MB of activations a token with full recomputation).
With ``model.logits_chunk_tokens = C`` the last hidden states go to ``ChunkedLogprobs`` instead:
it runs the output projection, the temperature, log-softmax, the label gather and the entropy over
C tokens at a time and keeps only the per-token results; backward recomputes each chunk's logits
and accumulates the gradients of the hidden states and of the output weight (Liger-Kernel's fused
linear cross-entropy and Apple's Cut Cross-Entropy do the same on GPUs; here in plain torch, so it
runs on CPU and any accelerator). Peak extra memory: a few C x V FP32 buffers instead of N x V.

The chunked path is installed on megatron-core's ``output_layer`` (parameter names unchanged, so
checkpoints, Hugging Face import / export and resume are unaffected) and taken only when a call
asks for it (``output_request``): the model then returns [b, s, 2] = (log p(label), entropy) in
place of the logits. ``vocab_limit`` (the tokenizer's vocabulary, when we padded the embedding to
a multiple of 128) keeps padding rows out of the softmax and the entropy; they get no gradient.
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass

import torch

from backend.distributed.collectives import dist_sum
from backend.megatron_compat import import_megatron_module

from .vocab_parallel import label_slots, local_limit, slice_log_softmax, slice_of


@dataclass
class OutputRequest:
    """What the next forward's output layer computes in place of the logits."""

    labels: torch.Tensor  # [b, s] int64 targets
    chunk_tokens: int  # tokens per chunk (> 0)
    temperature: float = 1.0
    entropy: str = ""  # "" none, "value" (no gradient), "grad" (differentiable)
    vocab_limit: int | None = None  # softmax over the first vocab_limit rows only
    grad_hint: torch.Tensor | None = None  # [b, s]: the gradient log p will receive, when known (cross-entropy)
    fused: str = ""  # "liger": sum(cross-entropy) over labels != -100 by Liger's kernel, in [s, b, 1] (see below)


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype a chunk's softmax runs in: FP32 for BF16 / FP16 compute (as the unchunked path's
    ``logits.float()``), the inputs' own otherwise."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


#: On CPU a chunk is at most this many tokens, whatever ``logits_chunk_tokens`` asks (less memory,
#: never more). The two buffers a call reuses are then at most 2 x 512 x V floats (622 MB at
#: Qwen3's 151,936 ids): a fresh buffer's pages are faulted in and zeroed by the kernel, and a
#: [4096, 151,936] log-softmax into a fresh buffer took 0.79 s against 0.24 s into a reused one
#: here, so one whole-microbatch chunk of 4,096 tokens ran a training step 1.3x slower than 512s
#: did. CUDA's caching allocator reuses its blocks: there the chunk is as asked.
CPU_MAX_CHUNK = 512


def effective_chunk(chunk: int, device: torch.device) -> int:
    """The tokens a chunk holds on ``device`` (``CPU_MAX_CHUNK`` at most on CPU)."""
    return min(chunk, CPU_MAX_CHUNK) if device.type == "cpu" else chunk


class _Buffers:
    """Two [chunk, V] buffers reused by every chunk of one call (FP32 / FP64 compute).

    A fresh [256, 151,936] FP32 buffer is 156 MB: on CPU each allocation of that size is a new
    mapping whose pages the kernel faults in and zeroes, about 40 ms a buffer measured here, three
    buffers a chunk. Reused, a microbatch pays for two whatever its chunk count. In BF16 / FP16
    compute (GPUs, whose caching allocator reuses blocks anyway) nothing is kept: ``get`` is None."""

    def __init__(self, rows: int, cols: int, h: torch.Tensor):
        keep = _wide(h.dtype) == h.dtype
        self.bufs = [torch.empty(rows, cols, dtype=h.dtype, device=h.device) for _ in range(2)] if keep else None

    def get(self, i: int, rows: int) -> torch.Tensor | None:
        return None if self.bufs is None else self.bufs[i][:rows]


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, temperature: float, out=None) -> torch.Tensor:
    if out is not None:  # FP32 / FP64: into the reused buffer (the same numbers as h @ W^T / T)
        z = torch.mm(h, weight.t(), out=out)
        return z.div_(temperature) if temperature != 1.0 else z
    z = (h @ weight.t()).to(_wide(h.dtype))  # as the unchunked path: logits in the compute dtype, then FP32
    return z / temperature if temperature != 1.0 else z


def _logp_chunk(h, w, lse, temperature, out=None):
    """log p [c, V] of a chunk from its saved logsumexp: one fused op in FP32 / FP64."""
    if _wide(h.dtype) == h.dtype:
        if out is not None:
            return torch.addmm(-lse[:, None], h, w.t(), alpha=1.0 / temperature, out=out)
        return torch.addmm(-lse[:, None], h, w.t(), alpha=1.0 / temperature)
    return _chunk_logits(h, w, temperature).sub_(lse[:, None])


def _chunk_grads(h, w, y, logp, g, g_ent, entropy, temperature, grad_h, grad_w, scratch=None, owned=None):
    """Add one chunk's gradients to ``grad_h`` (its rows) and ``grad_w`` (a [V', H] view in the
    wide dtype), consuming ``logp`` (and ``scratch``, a buffer of its shape, when given).

    With g = dL/dlog p(y) and z = h W^T / T: dL/dz = g (onehot(y) - p) - g_H p (log p + H).
    In FP32 / FP64 compute the big buffer stays the probabilities and every scaling happens on
    [chunk, H] or [V, H] tensors: dL/dh = (g (W[y] - p W) + E W) / T, dL/dW = (onehot - p)^T (g h)
    / T + E^T h / T, E = -g_H p (log p + H). In BF16 / FP16 compute dL/dz is built whole in FP32
    first and rounded once: rounding p before onehot - p would turn a confident token's 1 - p_y
    into 0 (BF16 steps are 2^-8 near 1) and bias every gradient.

    ``owned`` (a vocabulary slice under tensor parallelism): whether this slice holds each label;
    ``y`` is then the label's local row and the one-hot term counts only where it is held."""
    wide = grad_w.dtype if grad_w is not None else _wide(h.dtype)
    g = g[:, None].to(logp.dtype) / temperature
    g_pick = g if owned is None else g * owned[:, None]
    extra = None
    if g_ent is not None:
        p = torch.exp(logp, out=scratch) if scratch is not None else logp.exp()
        logp += entropy[:, None]
        logp *= p
        logp *= -g_ent[:, None].to(logp.dtype) / temperature
        extra = logp
    else:
        p = logp.exp_()
    del logp
    if _wide(h.dtype) != h.dtype:  # low-precision compute: dL/dz in FP32, rounded once
        dz = p.mul_(-g)
        if extra is not None:
            dz += extra
            del extra
        dz.scatter_add_(1, y[:, None], g_pick)
        dz16 = dz.to(h.dtype)
        del dz, p
        if grad_h is not None:
            grad_h += dz16 @ w
        if grad_w is not None:
            grad_w.addmm_(dz16.t().to(wide), h.to(wide))
        return
    gh = g * h
    if grad_h is not None:
        grad_h += g * (w[y] - p @ w) if owned is None else g_pick * w[y] - g * (p @ w)
        if extra is not None:
            grad_h += extra @ w
    if grad_w is not None:
        grad_w.addmm_(p.t().to(wide), gh.to(wide), alpha=-1.0)
        grad_w.index_add_(0, y, (gh if owned is None else g_pick * h).to(wide))
        if extra is not None:
            grad_w.addmm_(extra.t().to(wide), h.to(wide))


def _weight_grad(weight: torch.Tensor, limit: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the full [V, H] gradient in the wide dtype, its view over the first ``limit`` rows): the
    padding rows stay 0, with no second buffer to copy into."""
    full = torch.zeros(weight.shape, dtype=_wide(weight.dtype), device=weight.device)
    return full, (full[:limit] if limit is not None else full)


class ChunkedLogprobs(torch.autograd.Function):
    """(log p(label), entropy) per token from hidden states [N, H] and the output weight [V, H],
    never holding more than one chunk's logits; see the module docstring. Forward keeps each
    token's logsumexp (and entropy), so backward recomputes a chunk's logits with one matmul and
    turns them into the logits' gradient in place: at most two [chunk, V] FP32 buffers.

    ``grad_hint`` (the gradient the caller will send to log p, when it is known before the
    forward: the cross-entropy objective's -loss_weight / N) lets forward compute the gradients
    of the hidden states and of the weight while each chunk's probabilities are at hand, as fused
    linear cross-entropy does: three matmuls over the vocabulary, as the unchunked path makes,
    instead of four. Backward then scales them by c when the gradient that arrives is c x the
    hint, and recomputes otherwise (never a wrong gradient)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk, temperature, vocab_limit, want_entropy, grad_hint, tp=None):
        chunk = effective_chunk(chunk, hidden.device)
        owned = None
        if tp is not None:  # this rank's slice of the vocabulary (vocab_parallel): labels as local rows
            start, rows = slice_of(tp, weight.shape[0])
            vocab_limit = local_limit(vocab_limit, start, rows)
            rows = rows if vocab_limit is None else vocab_limit
            labels, owned = label_slots(labels, start, rows)
        w = weight[:vocab_limit] if vocab_limit is not None else weight
        n = hidden.shape[0]
        wide = _wide(hidden.dtype)
        lp = torch.empty(n, dtype=wide, device=hidden.device)
        lse = torch.empty(n, dtype=wide, device=hidden.device)
        ent = torch.empty(n, dtype=wide, device=hidden.device) if want_entropy else None
        fused = grad_hint is not None and not want_entropy and (ctx.needs_input_grad[0] or ctx.needs_input_grad[1])
        grad_h = torch.zeros_like(hidden) if fused and ctx.needs_input_grad[0] else None
        grad_w_full, grad_w = _weight_grad(weight, vocab_limit) if fused and ctx.needs_input_grad[1] else (None, None)
        bufs = _Buffers(min(chunk, n), w.shape[0], hidden)
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            y = labels[s:e, None]
            z = _chunk_logits(hidden[s:e], w, temperature, out=bufs.get(0, e - s))
            if tp is not None:
                logp = _slice_logp(z, y[:, 0], owned[s:e], tp, lp[s:e], lse[s:e], bufs.get(1, e - s))
            else:
                lp_out = bufs.get(1, e - s)
                # one fused pass (faster on CPU than logsumexp)
                logp = (
                    torch.log_softmax(z, dim=-1)
                    if lp_out is None
                    else torch.ops.aten._log_softmax.out(z, 1, False, out=lp_out)
                )
                lp[s:e] = logp.gather(1, y)[:, 0]
                lse[s:e] = z.gather(1, y)[:, 0] - lp[s:e]
            del z
            if want_entropy:  # H = -sum p log p, a row-wise dot product (p into the logits' buffer)
                scratch = bufs.get(0, e - s)
                p = torch.exp(logp, out=scratch) if scratch is not None else logp.exp()
                h_part = -torch.linalg.vecdot(p, logp)
                ent[s:e] = h_part if tp is None else dist_sum(h_part, tp)
                del p
            if fused:
                rows = grad_h[s:e] if grad_h is not None else None
                part = None if owned is None else owned[s:e]
                _chunk_grads(
                    hidden[s:e], w, labels[s:e], logp, grad_hint[s:e], None, None, temperature, rows, grad_w, owned=part
                )
            del logp
        del bufs
        ctx.fused = (grad_hint, grad_h, grad_w_full) if fused else None
        ctx.set_materialize_grads(False)  # an unused (or detached) entropy sends None, not zeros to add
        ctx.save_for_backward(hidden, weight, labels, lse, ent if want_entropy else lse)
        ctx.chunk, ctx.temperature, ctx.vocab_limit, ctx.want_entropy = chunk, temperature, vocab_limit, want_entropy
        ctx.owned = owned
        if ent is None:
            return lp, torch.zeros(0, device=hidden.device)
        return lp, ent

    @staticmethod
    def backward(ctx, grad_lp, grad_ent):
        hidden, weight, labels, lse, entropy = ctx.saved_tensors
        chunk, temperature, limit, owned = ctx.chunk, ctx.temperature, ctx.vocab_limit, ctx.owned
        w = weight[:limit] if limit is not None else weight
        n = hidden.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = grad_w = None
        if grad_lp is None:
            grad_lp = torch.zeros(n, dtype=lse.dtype, device=lse.device)
        if ctx.fused is not None:
            hint, grad_h, grad_w = ctx.fused
            ctx.fused = None
            scale = float(
                torch.dot(grad_lp.double(), hint.double()) / torch.dot(hint.double(), hint.double()).clamp_min(1e-300)
            )
            if not torch.allclose(grad_lp, hint * scale, rtol=1e-6, atol=0):
                grad_h = grad_w = None  # another gradient than the hint's: recompute below
            else:
                grad_h = grad_h * scale if grad_h is not None else None
                grad_w = grad_w * scale if grad_w is not None else None
        if grad_h is None and grad_w is None:
            grad_h = torch.zeros_like(hidden) if need_h else None
            grad_w, grad_w_rows = _weight_grad(weight, limit) if need_w else (None, None)
            with_entropy = ctx.want_entropy and grad_ent is not None and grad_ent.numel() == n
            bufs = _Buffers(min(chunk, n), w.shape[0], hidden)
            for s in range(0, n, chunk):
                e = min(n, s + chunk)
                h = hidden[s:e]
                logp = _logp_chunk(h, w, lse[s:e], temperature, out=bufs.get(0, e - s))
                _chunk_grads(
                    h,
                    w,
                    labels[s:e],
                    logp,
                    grad_lp[s:e],
                    grad_ent[s:e] if with_entropy else None,
                    entropy[s:e] if with_entropy else None,
                    temperature,
                    grad_h[s:e] if grad_h is not None else None,
                    grad_w_rows,
                    scratch=bufs.get(1, e - s),
                    owned=None if owned is None else owned[s:e],
                )
            del bufs
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)  # padding rows: no gradient
        return grad_h, grad_w, None, None, None, None, None, None, None


def _slice_logp(z, y, owned, tp, lp_out, lse_out, scratch):
    """log p of a chunk over a vocabulary split across ``tp`` (``slice_log_softmax``), into
    ``scratch`` (or a new tensor); the exponentials go to the logits' buffer ``z``, free by then.
    Writes log p(label) and the logsumexp into ``lp_out`` / ``lse_out``."""
    logp, lp, lse = slice_log_softmax(z, y, owned, tp, out=scratch, exp_out=z)
    lp_out.copy_(lp)
    lse_out.copy_(lse)
    return logp


def chunked_logprobs(
    hidden, weight, labels, *, chunk, temperature=1.0, vocab_limit=None, entropy="", grad_hint=None, tp=None
):
    """(log p [N], entropy [N] or None) of ``hidden`` [N, H]; ``entropy`` as ``OutputRequest``;
    ``grad_hint``: the gradient log p will receive, when known (see ``ChunkedLogprobs``); ``tp``:
    the tensor-parallel group when ``weight`` is this rank's slice of the vocabulary (the caller
    has gathered ``hidden`` and sums its gradient over the group)."""
    lp, ent = ChunkedLogprobs.apply(
        hidden, weight, labels, chunk, temperature, vocab_limit, bool(entropy), grad_hint, tp
    )
    if not entropy:
        return lp, None
    return lp, (ent if entropy == "grad" else ent.detach())


def _chunked_forward(self, input_, weight=None, runtime_gather_output=None, **kwargs):
    """megatron-core's output-layer call; with a pending request, (lp, entropy) in place of logits."""
    request: OutputRequest | None = getattr(self, "_output_request", None)
    if request is None:
        return self._unchunked_forward(input_, weight=weight, runtime_gather_output=runtime_gather_output, **kwargs)
    w = weight if weight is not None else self.weight
    if request.fused == "liger":
        return liger_loss_sum(input_, w, request), None
    tp = self.tp_group if self.tp_group is not None and self.tp_group.size() > 1 else None
    if tp is not None:  # the whole sequence on every TP rank; the hidden states' gradient summed over TP
        mappings = import_megatron_module("megatron.core.tensor_parallel.mappings")
        if self.sequence_parallel:
            input_ = mappings.gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True, group=tp)
        else:
            input_ = mappings.copy_to_tensor_model_parallel_region(input_, group=tp)
    s, b, hidden_size = input_.shape
    labels = request.labels.t().reshape(-1)  # [b, s] -> the hidden states' [s, b] order
    hint = None if request.grad_hint is None else request.grad_hint.t().reshape(-1).to(torch.float32)
    lp, ent = chunked_logprobs(
        input_.reshape(s * b, hidden_size),
        w,
        labels,
        chunk=request.chunk_tokens,
        temperature=request.temperature,
        vocab_limit=request.vocab_limit,
        entropy=request.entropy,
        grad_hint=hint,
        tp=tp,
    )
    ent = ent if ent is not None else torch.zeros_like(lp)
    return torch.stack([lp, ent], dim=-1).reshape(s, b, 2), None


def liger_loss_sum(input_: torch.Tensor, weight: torch.Tensor, request: OutputRequest) -> torch.Tensor:
    """sum of cross-entropy over the tokens whose label is not -100, by Liger-Kernel's fused
    linear cross-entropy (reduction "sum": its gradient is computed in its forward and scaled by
    the one upstream number, correct in every release; "none" with per-token upstream gradients
    was not until a late release), returned as an [s, b, 1] broadcast of the scalar so it leaves
    megatron-core's output path like logits; the caller reads element [0, 0, 0]."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    s, b, hidden_size = input_.shape
    w = weight[: request.vocab_limit] if request.vocab_limit else weight
    labels = request.labels.t().reshape(-1)
    total = liger_fused_linear_cross_entropy(
        input_.reshape(s * b, hidden_size), w, labels, ignore_index=-100, reduction="sum"
    )
    return total.float().reshape(1, 1, 1).expand(s, b, 1)


def install_chunked_output(model: torch.nn.Module) -> None:
    """Let ``model``'s output layer take requests (``output_request``); names and weights unchanged."""
    layer = model.output_layer
    if getattr(layer, "_unchunked_forward", None) is None:
        layer._unchunked_forward = layer.forward
        layer.forward = types.MethodType(_chunked_forward, layer)


@contextlib.contextmanager
def output_request(model: torch.nn.Module, request: OutputRequest):
    """The next forward of ``model`` returns [b, s, 2] (lp, entropy) computed chunk by chunk."""
    layer = model.output_layer
    if getattr(layer, "_unchunked_forward", None) is None:
        raise RuntimeError("the model's output layer has no chunked path (install_chunked_output)")
    layer._output_request = request
    try:
        yield
    finally:
        layer._output_request = None
