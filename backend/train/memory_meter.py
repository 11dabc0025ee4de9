"""This step's peak memory, one interface for both devices.

- CUDA: the caching allocator's statistics (peak allocated and reserved since the step began,
  the device's capacity from ``mem_get_info``).
- CPU: torch keeps no allocator statistics and the process RSS only grows, so the bytes of live
  tensors are counted: every storage an operator returns is added once (by its storage, so views
  and in-place results count nothing) and subtracted when the storage is freed (storages keep
  their Python object while alive, so a weak reference's callback fires exactly then). Tensors
  alive before the step (parameters, gradients, optimizer state, buffers) are its baseline. A
  dispatch mode sees every operator the step runs (forward, backward, optimizer), including
  FSDP2's gathers; what kernels allocate internally and free before returning is not seen.
  That mode costs 10-15 us of Python per operator: 40% of the tiny GRPO demo's training step and
  11% of a 4-layer x 512 model's (``tools/bench/bench_rl_vs_trl.py``), so ``train.memory_meter``
  decides where it runs (``enabled=False``: ``step`` measures nothing, ``peak_bytes`` is None).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves


def _plain(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """The tensors holding ``t``'s memory (a DTensor's local shard, not its wrapper)."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        for name in names:
            inner = getattr(t, name)
            if isinstance(inner, torch.Tensor):
                yield from _plain(inner)
    else:
        yield t


class LiveTensorBytes(TorchDispatchMode):
    """Counts the bytes of live tensor storages; ``peak`` since ``reset``."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def add(self, t: torch.Tensor) -> None:
        for inner in _plain(t):
            if inner.device.type == "meta":
                continue
            storage = inner.untyped_storage()
            key = storage._cdata
            if key in self.live:
                continue
            size = storage.nbytes()
            self.live[key] = size
            self.current += size
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def reset(self) -> None:
        self.peak = self.current

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.add(t)
        return out


class MemoryMeter:
    """``with meter.step(): ...`` then ``meter.peak_bytes`` (and on CUDA ``reserved_bytes``)."""

    def __init__(self, device: torch.device, resident: Iterable[torch.Tensor] = (), *, enabled: bool = True):
        self.device = device
        self.enabled = enabled
        self.peak_bytes: int | None = 0 if enabled else None
        self.reserved_bytes: int | None = 0 if enabled else None
        self._cpu = LiveTensorBytes() if device.type != "cuda" and enabled else None
        if self._cpu is not None:
            for t in resident:
                self._cpu.add(t)

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count tensors that became resident outside a step (a loaded optimizer state)."""
        if self._cpu is not None:
            for t in tensors:
                self._cpu.add(t)

    def capacity_bytes(self) -> int | None:
        """The device's total memory (CUDA); None on CPU, where the limit must be given."""
        if self.device.type == "cuda":
            return int(torch.cuda.mem_get_info(self.device)[1])
        return None

    @contextlib.contextmanager
    def step(self):
        if not self.enabled:
            yield self
            return
        if self._cpu is None:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            yield self
            torch.cuda.synchronize(self.device)
            self.peak_bytes = int(torch.cuda.max_memory_allocated(self.device))
            self.reserved_bytes = int(torch.cuda.max_memory_reserved(self.device))
            return
        self._cpu.reset()
        with self._cpu:
            yield self
        self.peak_bytes = self.reserved_bytes = self._cpu.peak


def resident_tensors(model: torch.nn.Module, optimizer=None) -> list[torch.Tensor]:
    """Parameters, their gradients, buffers and optimizer state: what a step starts with."""
    out = [p for p in model.parameters()] + [b for b in model.buffers()]
    out += [p.grad for p in model.parameters() if p.grad is not None]
    if optimizer is not None:
        for state in optimizer.state.values():
            out += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return out
