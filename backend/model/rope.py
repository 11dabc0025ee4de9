"""Rotary position embedding (RoPE) applied by our core attention from global positions.

We apply RoPE ourselves rather than through megatron-core's rotary module: it is computed from
each token's global position, so it stays right under context parallelism (a rank holds chunks
i and 2c-1-i of a row) and needs none of megatron-core's CUDA-only rotary code.

The frequencies come from ``backend.model.hf.rope``, which repeats transformers' arithmetic
for plain, linear, Llama 3 and YaRN RoPE bitwise: every model (imported or not) gets scaled RoPE
from ``model.rope_scaling``, and an imported Llama 3.1 sees the angles it was trained with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .hf.rope import cos_sin, inv_freq


@dataclass(frozen=True)
class Rope:
    """RoPE for one model (hashable: the per-microbatch cache key of its cos/sin tables).

    ``scaling`` is a HF ``rope_scaling`` dict frozen as sorted (key, value) pairs, empty for plain
    RoPE; ``max_position_embeddings`` is read only by YaRN without a factor.
    """

    head_dim: int
    base: float = 10000.0
    scaling: tuple = ()
    max_position_embeddings: int = 0

    @classmethod
    def from_config(cls, model_cfg, head_dim: int, max_position_embeddings: int) -> Rope:
        """From ``model.rotary_base`` and ``model.rope_scaling`` (a RopeScalingConfig)."""
        hf = model_cfg.rope_scaling.to_hf()
        return cls(
            head_dim=head_dim,
            base=float(model_cfg.rotary_base),
            scaling=tuple(sorted(hf.items())) if hf else (),
            max_position_embeddings=max_position_embeddings,
        )

    def frequencies(self) -> tuple[torch.Tensor, float]:
        """(inverse frequencies [head_dim / 2] FP32 on the CPU, cos/sin attention factor)."""
        return inv_freq(
            self.head_dim,
            self.base,
            dict(self.scaling) or None,
            max_position_embeddings=self.max_position_embeddings or None,
        )

    def inv_freq(self, device) -> torch.Tensor:
        """[head_dim / 2] inverse frequencies, FP32."""
        return self.frequencies()[0].to(device)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin as [s, b, 1, head_dim] for ``positions`` [b, s] (rotate-half layout)."""
        inv, attention_factor = self.frequencies()
        cos, sin = cos_sin(positions.t(), inv, attention_factor, dtype)  # [s, b, head_dim]
        return cos[:, :, None, :], sin[:, :, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x rotated by the (cos, sin) tables of ``Rope.tables`` (rotate-half layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
