"""One megatron-core parameter and the Hugging Face tensors it is made of (``ParamMap``), with the
maps every model family shares: a tensor copied as is, and the grouped QKV layout (see
``mapping`` for the layouts). The family tables (``mapping`` for Llama / Qwen, ``gpt_oss``) both
build on this module and neither imports the other's internals."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParamMap:
    """One megatron-core parameter and the HF tensors it is built from (in ``hf`` order)."""

    megatron: str
    hf: tuple[str, ...]
    to_megatron: Callable[[Sequence[torch.Tensor]], torch.Tensor]
    to_hf: Callable[[torch.Tensor], list[torch.Tensor]]

    @property
    def is_copy(self) -> bool:
        """One HF tensor, unchanged: a loader may read just the rows its shard needs."""
        return self.to_megatron is copy_in


def copy_in(ts: Sequence[torch.Tensor]) -> torch.Tensor:
    return ts[0]


def copy_out(t: torch.Tensor) -> list[torch.Tensor]:
    return [t]


def qkv_maps(fields: dict) -> tuple[Callable, Callable]:
    n, g, h = fields["num_attention_heads"], fields["num_query_groups"], fields["head_dim"]
    per = n // g

    def to_megatron(ts: Sequence[torch.Tensor]) -> torch.Tensor:
        q, k, v = ts
        rest = q.shape[1:]
        for what, t, rows in (("q", q, n * h), ("k", k, g * h), ("v", v, g * h)):
            if t.shape[0] != rows or t.shape[1:] != rest:
                raise ValueError(
                    f"{what}_proj has shape {tuple(t.shape)}, expected ({rows}, {', '.join(map(str, rest))})"
                )
        grouped = torch.cat([q.reshape(g, per, h, *rest), k.reshape(g, 1, h, *rest), v.reshape(g, 1, h, *rest)], dim=1)
        return grouped.reshape((n + 2 * g) * h, *rest)

    def to_hf(t: torch.Tensor) -> list[torch.Tensor]:
        if t.shape[0] != (n + 2 * g) * h:
            raise ValueError(f"linear_qkv has {t.shape[0]} rows, expected (n + 2g) * h = {(n + 2 * g) * h}")
        rest = t.shape[1:]
        grouped = t.reshape(g, per + 2, h, *rest)
        q, k, v = grouped.split([per, 1, 1], dim=1)
        return [x.reshape(-1, *rest).contiguous() for x in (q, k, v)]

    return to_megatron, to_hf
