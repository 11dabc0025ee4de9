"""megatron-core 0.16.1's tensor-parallel layers on CPU: two narrow fixes.

The layers (``ColumnParallelLinear``, ``RowParallelLinear``, ``VocabParallelEmbedding``) compute
with plain torch and talk over the tensor-parallel group with ``torch.distributed`` calls that
gloo runs, but their sequence-parallel paths allocate their communication buffers with
``torch.cuda.current_device()`` (``mappings._gather_along_first_dim``,
``_reduce_scatter_along_first_dim``, the backward of ``LinearWithGradAccumulationAndAsyncCommunication``
and ``GlobalMemoryBuffer.get_tensor``, whose buffer the forward all-gather reuses): on a CPU-only
torch each raises "Torch not compiled with CUDA enabled". And the embedding's sequence-parallel
dropout forks the CUDA RNG tracker, which has no state on CPU. ``apply_tp_compat()`` patches
exactly these, once per process, and only where CUDA is absent (a CUDA process runs megatron-core
untouched):

1. In ``tensor_parallel.mappings``, ``tensor_parallel.layers`` and ``utils`` the name ``torch``
   becomes a view of torch whose ``cuda.current_device()`` is the CPU: the buffers are allocated
   where the tensors are; every other attribute is torch's own.
2. The RNG tracker's ``fork`` is a no-op context: dropout is 0 in every model built here
   (``hidden_dropout`` and ``attention_dropout``), so no random number is drawn inside it.
"""

from __future__ import annotations

import contextlib

import torch

from backend.megatron_compat import import_megatron_module

_APPLIED: list[str] = []


class _CpuCuda:
    """``torch.cuda`` whose current device is the CPU."""

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")


class _TorchOnCpu:
    """``torch`` with ``cuda`` replaced by ``_CpuCuda`` (attribute lookups only: types, functions
    and submodules are torch's own objects, so ``isinstance(x, torch.Tensor)`` is unchanged)."""

    cuda = _CpuCuda()

    def __getattr__(self, name):
        return getattr(torch, name)


def apply_tp_compat() -> None:
    """Make megatron-core's tensor-parallel layers run on a CPU-only torch (idempotent)."""
    if _APPLIED or torch.cuda.is_available():
        return
    shim = _TorchOnCpu()
    for name in (
        "megatron.core.tensor_parallel.mappings",
        "megatron.core.tensor_parallel.layers",
        "megatron.core.utils",
    ):
        import_megatron_module(name).torch = shim
    random = import_megatron_module("megatron.core.tensor_parallel.random")
    random.CudaRNGStatesTracker.fork = lambda self, *args, **kwargs: contextlib.nullcontext()
    _APPLIED.append("tp")
