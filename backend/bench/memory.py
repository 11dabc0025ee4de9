"""Peak memory of a step, measured the same way for every arm.

On CUDA the caching allocator's peak is exact. On CPU torch keeps no allocator statistics, and
the process RSS only grows, so we measure what dominates and what batching changes: the bytes of
tensors autograd saves for the backward pass (activations), summed per microbatch (each
microbatch's are freed by its backward), peak over the step's microbatches.
"""

from __future__ import annotations

import contextlib

import torch


class SavedActivationMeter:
    """Context manager counting the distinct storages autograd saves; ``peak`` over resets."""

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0
        self._seen: set[int] = set()

    def reset_microbatch(self) -> None:
        self.current = 0
        self._seen.clear()

    def _pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in self._seen:
            self._seen.add(key)
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
        return t

    @contextlib.contextmanager
    def watch(self):
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield self

    def microbatch(self, _index: int):
        """A ``train_step`` microbatch hook: count this microbatch's saved tensors from zero."""
        self.reset_microbatch()
        return self.watch()
