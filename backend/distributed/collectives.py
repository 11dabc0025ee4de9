"""Named collective helpers: every cross-rank reduction in the trainer and tools goes through here.

A named helper says what is agreed (a maximum, a sum, a list of every rank's object) and keeps
the device handling in one place: NCCL needs CUDA tensors, gloo CPU ones.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def dist_sum(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``tensor`` over the group, in place; returns it."""
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def dist_max(value: float, device: torch.device, group=None) -> float:
    """The largest ``value`` over the group (e.g. the slowest rank's time, the largest peak memory)."""
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def dist_max_tensor(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Element-wise maximum of ``tensor`` over the group, in place (a minimum is the max of -x)."""
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor


def dist_any(flag: bool, device: torch.device, group=None) -> bool:
    """True on every rank when it is true on any rank (one tiny all-reduce)."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def all_gather_objects(obj, group=None) -> list:
    """Every rank's picklable ``obj``, in rank order (small metadata only: it pickles)."""
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def all_gather_tensors(tensor: torch.Tensor, group=None) -> list[torch.Tensor]:
    """Every rank's same-shaped ``tensor``, in rank order."""
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return parts
