"""Core attention behind one interface: ``sdpa``, ``flex`` and ``te``, chosen by name.

megatron-core builds each layer's ``core_attention`` from the layer spec; we put our own module
there. It receives query/key/value as [s, b, heads, head_dim] and whatever the model was given
as ``attention_mask``: we pass an ``AttentionContext`` holding the microbatch's global positions
and validity (right padding), so every backend runs the microbatch's local padded shape with
the same semantics: causal on global positions, padded keys never attended. RoPE is applied
here from the global positions, which keeps it correct under context parallelism and needs
none of megatron-core's CUDA-only rotary code.

Under context parallelism each rank holds two chunks of every row's queries; keys and values
are all-gathered across the CP group (the backward reduce-scatters their gradients back to the
owners) and masked by global position, so the gathered order does not matter.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from backend.config.schema import ATTENTION_KERNELS
from backend.megatron_compat import import_megatron_module, te_status

from . import packed_attention, sinks_windows
from .rope import Rope
from .sinks_windows import layer_window

log = logging.getLogger(__name__)


class _GatherFromCP(torch.autograd.Function):
    """All-gather along dim 0 of a [s, ...] tensor; backward sums gradients back to the owners."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _gather_plain(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        world = dist.get_world_size(ctx.group)
        out = torch.empty((grad.shape[0] // world, *grad.shape[1:]), dtype=grad.dtype, device=grad.device)
        dist.reduce_scatter_tensor(out, grad.contiguous(), group=ctx.group)
        return out, None


def gather_cp(x: torch.Tensor, group) -> torch.Tensor:
    """[s_local, ...] from every CP rank, concatenated in rank order along dim 0 (differentiable)."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _GatherFromCP.apply(x, group)


def _gather_plain(x: torch.Tensor, group) -> torch.Tensor:
    world = dist.get_world_size(group)
    out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


@dataclass
class AttentionContext:
    """One microbatch's attention facts, shared by every layer (built once per microbatch).

    What every layer derives from them (gathered key positions, the mask, RoPE tables, a flex
    BlockMask) is computed by the first layer and reused through ``cached``: with 36 layers the
    mask and tables are built once instead of 36 times.
    """

    positions: torch.Tensor  # [b, s_local] int64 global positions of this rank's tokens
    valid: torch.Tensor  # [b, s_local] bool, False at right padding
    cp_group: object = None
    # Packed layout only (b = 1; see packed_attention): the sequence each token belongs to, and
    # cumulative real / per-sequence padded lengths over the whole row (before the CP cut).
    segment_ids: torch.Tensor | None = None  # [1, s_local] int64
    cu_seqlens: torch.Tensor | None = None  # [n + 1] int32
    cu_seqlens_padded: torch.Tensor | None = None  # [n + 1] int32
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def is_packed(self) -> bool:
        return self.segment_ids is not None

    def cached(self, key, build: Callable[[], object]):
        """``build()`` once per microbatch under ``key``, then the stored value."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def key_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions, valid) of every key: this rank's, or the CP group's gathered."""

        def build():
            pos, valid = self.positions, self.valid
            if self.cp_group is not None and dist.get_world_size(self.cp_group) > 1:
                pos = _gather_plain(pos.t(), self.cp_group).t()
                valid = _gather_plain(valid.t().to(torch.uint8), self.cp_group).t().bool()
            return pos, valid

        return self.cached("keys", build)

    def dense_mask(self) -> torch.Tensor:
        """[b, 1, s_q, s_k] bool, True where a query may attend a key."""

        def build():
            kpos, kvalid = self.key_positions()
            return ((kpos[:, None, :] <= self.positions[:, :, None]) & kvalid[:, None, :])[:, None]

        return self.cached("dense", build)

    def rope(self, rope: Rope, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin as [s, b, 1, head_dim] for this rank's positions (rotate-half layout)."""
        return self.cached(("rope", rope, dtype), lambda: rope.tables(self.positions, dtype))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


# ---- kernels: q [b, h, sq, d], k/v [b, hk, sk, d] -> [b, h, sq, d] ---------------------------------


def sdpa_kernel(q, k, v, ctx: AttentionContext, scale: float) -> torch.Tensor:
    if ctx.is_packed:  # one SDPA per sequence: cost sum(l_i^2), never a (total x total) mask
        return packed_attention.sdpa_packed(q, k, v, ctx, scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=ctx.dense_mask(), scale=scale, enable_gqa=True)


@functools.cache
def _compiled_flex_attention() -> Callable:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_kernel(q, k, v, ctx: AttentionContext, scale: float) -> torch.Tensor:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def build():
        kpos, kvalid = ctx.key_positions()
        qpos = ctx.positions

        def mask_mod(b, h, q_idx, kv_idx):
            return (kpos[b, kv_idx] <= qpos[b, q_idx]) & kvalid[b, kv_idx]

        # Blocks whose keys are all padding or all in the future are skipped entirely.
        return create_block_mask(mask_mod, q.shape[0], None, q.shape[2], k.shape[2], device=q.device, BLOCK_SIZE=128)

    fn = _compiled_flex_attention() if q.is_cuda else flex_attention  # eager on CPU (forward only)
    if ctx.is_packed:  # document mask: cross-sequence blocks are skipped
        block_mask = packed_attention.flex_packed_block_mask(ctx, q, k)
    else:
        block_mask = ctx.cached("block_mask", build)
    return fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)


def te_kernel_factory(num_heads: int, num_kv: int, head_dim: int, scale: float, *, window: int = 0, sinks=False):
    """Transformer Engine: THD for packed rows, padding_causal / two bottom-right calls per layer
    for padded ones (see packed_attention); never the arbitrary-mask unfused fallback. GPT-OSS
    windows and sinks go to TE itself (``window_size``, ``softmax_type="learnable"``)."""
    return packed_attention.te_kernel_factory(num_heads, num_kv, head_dim, scale, window=window, sinks=sinks)


_KERNELS = {"sdpa": sdpa_kernel, "flex": flex_kernel}


def resolve_backend(name: str, *, device: torch.device, training: bool = True, sinks_or_windows: bool = False) -> str:
    """The backend to use for ``model.attention_backend``; ``auto`` picks and logs, never silently."""
    te_ok, te_why = te_status()
    if name == "auto":
        if device.type == "cuda" and sinks_or_windows:
            choice, why = (
                "flex",
                (
                    "CUDA with attention sinks / sliding windows: flex runs them in every dtype and TE version "
                    "(te needs Transformer Engine >= 2.8 and cuDNN >= 9.13 for sinks: choose it explicitly)"
                ),
            )
        elif device.type == "cuda" and te_ok:
            choice, why = "te", "CUDA and Transformer Engine are available"
        elif device.type == "cuda":
            choice, why = "flex", f"CUDA without Transformer Engine ({te_why})"
        else:
            choice, why = "sdpa", "no CUDA device: SDPA is the CPU training path"
        log.info("model.attention_backend=auto -> %s (%s)", choice, why)
        return choice
    if name == "te" and not (te_ok and device.type == "cuda"):
        raise RuntimeError(f"model.attention_backend=te needs CUDA and Transformer Engine: {te_why}; device={device}")
    if name == "flex" and training and device.type != "cuda":
        raise RuntimeError(
            "model.attention_backend=flex trains only on CUDA (FlexAttention has no CPU backward); "
            "use sdpa on CPU, or flex for forward-only passes"
        )
    if name not in ATTENTION_KERNELS:
        raise ValueError(f"model.attention_backend={name!r}: allowed values are auto, {', '.join(ATTENTION_KERNELS)}")
    return name


@functools.cache
def core_attention_class(backend: str) -> type:
    """The megatron-core core-attention module running ``backend`` (built once per backend and
    named after it, e.g. SdpaCoreAttention, so a model's printout says which kernel it runs; RoPE
    comes in as a constructor parameter through the layer spec's ``params``)."""
    megatron_module = import_megatron_module("megatron.core.transformer.module").MegatronModule

    class CoreAttention(megatron_module):
        def __init__(
            self,
            config,
            layer_number,
            attn_mask_type=None,
            attention_type=None,
            cp_comm_type=None,
            softmax_scale=None,
            pg_collection=None,
            *,
            rope: Rope,
            **_,
        ):
            super().__init__(config=config)
            self.num_heads = config.num_attention_heads
            self.num_kv = config.num_query_groups or config.num_attention_heads
            self.head_dim = config.kv_channels
            self.scale = softmax_scale if softmax_scale is not None else self.head_dim**-0.5
            self.rope_spec = rope
            # GPT-OSS: a sliding window on this layer (0 = full) and learnable sinks (HF ``sinks``).
            self.window = layer_window(config.window_size, config.window_attn_skip_freq, layer_number)
            self.softmax_offset = None
            if getattr(config, "softmax_type", "vanilla") == "learnable":
                self.softmax_offset = torch.nn.Parameter(torch.zeros(self.num_heads))
            if backend == "te":
                self.te_attention, self.kernel = te_kernel_factory(
                    self.num_heads,
                    self.num_kv,
                    self.head_dim,
                    self.scale,
                    window=self.window,
                    sinks=self.softmax_offset is not None,
                )
            elif self.window or self.softmax_offset is not None:
                self.kernel = functools.partial(sinks_windows.KERNELS[backend], window=self.window)
            else:
                self.kernel = _KERNELS[backend]

        def forward(
            self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
        ):
            ctx: AttentionContext = attention_mask
            if not isinstance(ctx, AttentionContext):
                raise TypeError(
                    "CoreAttention needs an AttentionContext as attention_mask (see backend.model.builder.token_losses)"
                )
            s, b = query.shape[0], query.shape[1]
            cos, sin = ctx.rope(self.rope_spec, query.dtype)
            query, key = apply_rope(query, cos, sin), apply_rope(key, cos, sin)
            if not getattr(self.kernel, "local_kv", False):  # te gathers (or lets TE exchange) itself
                key, value = gather_cp(key, ctx.cp_group), gather_cp(value, ctx.cp_group)
            # [s, b, h, d] -> [b, h, s, d]
            q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
            if self.softmax_offset is not None:
                out = self.kernel(q, k, v, ctx, self.scale, sinks=self.softmax_offset)
            else:
                out = self.kernel(q, k, v, ctx, self.scale)
            return out.permute(2, 0, 1, 3).reshape(s, b, self.num_heads * self.head_dim)

    CoreAttention.__name__ = CoreAttention.__qualname__ = f"{backend.capitalize()}CoreAttention"
    return CoreAttention


def core_attention_spec(backend: str, rope: Rope):
    """A megatron-core ModuleSpec placing our core attention with its backend and RoPE."""
    spec_cls = import_megatron_module("megatron.core.transformer.spec_utils").ModuleSpec
    return spec_cls(module=core_attention_class(backend), params={"rope": rope})
