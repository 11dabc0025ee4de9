"""``AttentionContext``: one microbatch's attention facts, built once and shared by every layer.

The model is given it as ``attention_mask``: the global positions and validity (right padding) of
this rank's tokens, the CP group, and for packed rows (b = 1, see ``layout``) the sequence of every
token with the row's cumulative real / padded lengths. What layers derive from it (gathered key
positions and sequence ids, masks, RoPE tables, a flex BlockMask, per-sequence plans) is built by
the first layer and reused through ``cached``: with 36 layers, once instead of 36 times.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..rope import Rope
from .cp import cp_size, gather_plain


@dataclass
class AttentionContext:
    """One microbatch's attention facts (see the module docstring)."""

    positions: torch.Tensor  # [b, s_local] int64 global positions of this rank's tokens
    valid: torch.Tensor  # [b, s_local] bool, False at right padding
    cp_group: object = None
    # Packed layout only (b = 1): the sequence each token belongs to, and cumulative real /
    # per-sequence padded lengths over the whole row (before the CP cut).
    segment_ids: torch.Tensor | None = None  # [1, s_local] int64
    cu_seqlens: torch.Tensor | None = None  # [n + 1] int32
    cu_seqlens_padded: torch.Tensor | None = None  # [n + 1] int32
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def is_packed(self) -> bool:
        return self.segment_ids is not None

    @property
    def cp_size(self) -> int:
        return cp_size(self.cp_group)

    def cached(self, key, build: Callable[[], object]):
        """``build()`` once per microbatch under ``key``, then the stored value."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def key_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions, valid) of every key: this rank's, or the CP group's gathered."""

        def build():
            pos, valid = self.positions, self.valid
            if self.cp_size > 1:
                pos = gather_plain(pos.t(), self.cp_group).t()
                valid = gather_plain(valid.t().to(torch.uint8), self.cp_group).t().bool()
            return pos, valid

        return self.cached("keys", build)

    def key_segment_ids(self) -> torch.Tensor:
        """[1, s_keys] sequence id of every key of a packed row: this rank's, or the CP group's
        gathered (rank order)."""

        def build():
            seg = self.segment_ids
            if self.cp_size > 1:
                seg = gather_plain(seg.t().contiguous(), self.cp_group).t()
            return seg

        return self.cached("key_segments", build)

    def segments(self) -> tuple[list[int], list[int]]:
        """(real lengths, padded lengths) of a packed row's sequences, as Python ints."""

        def build():
            cu = self.cu_seqlens.tolist()
            cu_pad = self.cu_seqlens_padded.tolist()
            return [b - a for a, b in zip(cu, cu[1:])], [b - a for a, b in zip(cu_pad, cu_pad[1:])]

        return self.cached("segments", build)

    def rope(self, rope: Rope, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin as [s, b, 1, head_dim] for this rank's positions (rotate-half layout)."""
        return self.cached(("rope", rope, dtype), lambda: rope.tables(self.positions, dtype))
