"""Rotary position embedding (RoPE) applied by our core attention from global positions.

We apply RoPE ourselves rather than through megatron-core's rotary module: it is computed from
each token's global position, so it stays right under context parallelism (a rank holds chunks
i and 2c-1-i of a row) and needs none of megatron-core's CUDA-only rotary code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Rope:
    """RoPE frequencies for one model: the base and the head size (hashable: a cache key)."""

    head_dim: int
    base: float = 10000.0

    def inv_freq(self, device) -> torch.Tensor:
        """[head_dim / 2] inverse frequencies, FP32."""
        exponent = torch.arange(0, self.head_dim, 2, device=device, dtype=torch.float32) / self.head_dim
        return 1.0 / (self.base**exponent)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin as [s, b, 1, head_dim] for ``positions`` [b, s] (rotate-half layout)."""
        angles = positions.t().to(torch.float32)[..., None] * self.inv_freq(positions.device)  # [s, b, d/2]
        angles = torch.cat([angles, angles], dim=-1)[:, :, None, :]
        return angles.cos().to(dtype), angles.sin().to(dtype)
