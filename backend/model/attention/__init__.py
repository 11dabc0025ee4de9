"""Core attention: one package, cut by kernel, imported one way.

    layout, cp            pure index arithmetic of packed rows / TE's CP calls; the CP all-gather
    context               AttentionContext: one microbatch's positions, validity, segments, cache
    masks                 the mask rule once: dense masks and FlexAttention mask_mod / BlockMask
    sdpa, flex, te        one kernel each, one signature, windows and sinks as kernel parameters
    registry              the one kernel table and ``model.attention_backend=auto``'s choice
    core                  the megatron-core core-attention module and its layer spec

Each file imports only the ones above it (tests/unit/test_layout.py checks the order).
"""

from .context import AttentionContext
from .core import core_attention_class, core_attention_spec
from .cp import gather_cp
from .registry import KERNELS, resolve_backend

__all__ = ["KERNELS", "AttentionContext", "core_attention_class", "core_attention_spec", "gather_cp", "resolve_backend"]
