"""megatron-core 0.16.1's tensor-parallel layers here: two narrow fixes.

The layers (``ColumnParallelLinear``, ``RowParallelLinear``, ``VocabParallelEmbedding``) compute
with plain torch and talk over the tensor-parallel group with ``torch.distributed`` calls that
gloo runs, but their sequence-parallel paths allocate their communication buffers with
``torch.cuda.current_device()`` (``mappings._gather_along_first_dim``,
``_reduce_scatter_along_first_dim``, the backward of ``LinearWithGradAccumulationAndAsyncCommunication``
and ``GlobalMemoryBuffer.get_tensor``, whose buffer the forward all-gather reuses): on a CPU-only
torch each raises "Torch not compiled with CUDA enabled". And with sequence parallelism the
embedding's dropout and every transformer block's forward fork the CUDA RNG tracker, whose
"model-parallel-rng" state only megatron-core's ``model_parallel_cuda_manual_seed`` adds
(CUDA-only): unseeded, the fork raises on a GPU too. ``apply_tp_compat()`` patches exactly these,
once per process:

1. Where CUDA is absent, in ``tensor_parallel.mappings``, ``tensor_parallel.layers`` and ``utils``
   the name ``torch`` becomes a view of torch whose ``cuda.current_device()`` is the CPU: the
   buffers are allocated where the tensors are; every other attribute is torch's own.
2. On every device, the RNG tracker's ``fork`` is a no-op context: dropout is 0 in every model
   built here (``hidden_dropout`` and ``attention_dropout``) and weights are initialised on the CPU
   (``use_cpu_initialization``), so no random number is drawn inside it.
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
    """Make megatron-core's tensor-parallel layers run here (idempotent; see the module docstring)."""
    if _APPLIED:
        return
    random = import_megatron_module("megatron.core.tensor_parallel.random")
    random.CudaRNGStatesTracker.fork = lambda self, *args, **kwargs: contextlib.nullcontext()
    if not torch.cuda.is_available():
        shim = _TorchOnCpu()
        for name in (
            "megatron.core.tensor_parallel.mappings",
            "megatron.core.tensor_parallel.layers",
            "megatron.core.utils",
        ):
            import_megatron_module(name).torch = shim
    _APPLIED.append("tp")
