"""Context parallelism for attention: the CP group's size and the all-gather of keys and values
along the sequence (dim 0), whose backward reduce-scatters the gradients back to their owners."""

from __future__ import annotations

import torch
import torch.distributed as dist


def cp_size(group) -> int:
    """The size of the CP group (1 without one)."""
    return dist.get_world_size(group) if group is not None else 1


def gather_plain(x: torch.Tensor, group) -> torch.Tensor:
    """[s_local, ...] from every rank of ``group`` in rank order along dim 0 (no gradient)."""
    world = dist.get_world_size(group)
    out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


class _GatherFromCP(torch.autograd.Function):
    """All-gather along dim 0 of a [s, ...] tensor; backward sums gradients back to the owners."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return gather_plain(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        world = dist.get_world_size(ctx.group)
        out = torch.empty((grad.shape[0] // world, *grad.shape[1:]), dtype=grad.dtype, device=grad.device)
        dist.reduce_scatter_tensor(out, grad.contiguous(), group=ctx.group)
        return out, None


def gather_cp(x: torch.Tensor, group) -> torch.Tensor:
    """[s_local, ...] from every CP rank, concatenated in rank order along dim 0 (differentiable)."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _GatherFromCP.apply(x, group)
