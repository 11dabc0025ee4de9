"""The megatron-core core-attention adapter: our module in each layer's ``core_attention`` slot.

megatron-core builds ``core_attention`` from the layer spec; it receives query/key/value as
[s, b, heads, head_dim] and whatever the model was given as ``attention_mask``: we pass an
``AttentionContext``, so every kernel runs the microbatch's local shape with the same semantics
(``masks``). RoPE is applied here from the global positions, which keeps it correct under
context parallelism and needs none of megatron-core's CUDA-only rotary code. Under CP each rank
holds two chunks of every row's queries; keys and values are all-gathered across the CP group
(``cp.gather_cp``) unless the kernel exchanges them itself.
"""

from __future__ import annotations

import functools

import torch

from backend.megatron_compat import import_megatron_module

from ..rope import Rope, apply_rope
from .context import AttentionContext
from .cp import gather_cp
from .layout import layer_window
from .registry import layer_kernel


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
            tp = config.tensor_model_parallel_size  # each TP rank computes heads / tp of them
            self.num_heads = config.num_attention_heads // tp
            self.num_kv = (config.num_query_groups or config.num_attention_heads) // tp
            self.head_dim = config.kv_channels
            self.scale = softmax_scale if softmax_scale is not None else self.head_dim**-0.5
            self.rope_spec = rope
            # GPT-OSS: a sliding window on this layer (0 = full) and learnable sinks (HF ``sinks``).
            self.window = layer_window(config.window_size, config.window_attn_skip_freq, layer_number)
            self.softmax_offset = None
            if getattr(config, "softmax_type", "vanilla") == "learnable":
                self.softmax_offset = torch.nn.Parameter(torch.zeros(self.num_heads))
                if tp > 1:  # this rank's heads' sinks: a contiguous block of the whole [heads] (as its q heads)
                    self.softmax_offset.tensor_model_parallel = True
                    self.softmax_offset.partition_dim, self.softmax_offset.partition_stride = 0, 1
            modules, self.kernel = layer_kernel(
                backend,
                num_heads=self.num_heads,
                num_kv=self.num_kv,
                head_dim=self.head_dim,
                scale=self.scale,
                window=self.window,
                sinks=self.softmax_offset is not None,
            )
            if modules is not None:  # Transformer Engine's modules (state-dict prefix te_attention.)
                self.te_attention = modules

        def forward(
            self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
        ):
            ctx: AttentionContext = attention_mask
            if not isinstance(ctx, AttentionContext):
                raise TypeError(
                    "CoreAttention needs an AttentionContext as attention_mask (see backend.model.forward.token_losses)"
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
