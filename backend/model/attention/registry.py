"""The one kernel table: ``model.attention_backend`` -> the kernel a layer runs, and ``auto``'s
choice (logged, never silent).

Every kernel has one signature, ``kernel(q, k, v, ctx, scale, *, sinks=None)`` with q [b, h, sq, d]
and k / v [b, hk, sk, d]; a layer's sliding window is bound when the layer is built. sdpa and
flex take keys CP-gathered; te takes them local (``kernel.local_kv``) and exchanges them itself.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from backend.config.schema import ATTENTION_KERNELS
from backend.megatron_compat import te_status

from .flex import flex_attention_kernel
from .sdpa import sdpa_attention
from .te import te_kernel_factory

log = logging.getLogger(__name__)

KERNELS: dict[str, Callable] = {"sdpa": sdpa_attention, "flex": flex_attention_kernel}


def layer_kernel(
    backend: str, *, num_heads: int, num_kv: int, head_dim: int, scale: float, window: int, sinks: bool
) -> tuple[torch.nn.Module | None, Callable]:
    """(modules the layer must register or None, kernel) for one layer of ``backend``.

    Transformer Engine builds its ``DotProductAttention`` modules per layer (their window and sink
    softmax are constructor arguments); sdpa and flex are functions with the window bound."""
    if backend == "te":
        return te_kernel_factory(num_heads, num_kv, head_dim, scale, window=window, sinks=sinks)
    kernel = KERNELS[backend]
    return None, (functools.partial(kernel, window=window) if window else kernel)


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
