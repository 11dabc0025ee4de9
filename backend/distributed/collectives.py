"""Named collective helpers: every cross-rank reduction in the trainer and tools goes through here.

A named helper says what is agreed (a maximum, a sum, a list of every rank's object) and keeps
the device handling in one place: NCCL needs CUDA tensors, gloo CPU ones. Every helper takes the
group it reduces over, with no default: the caller says which ranks count (``ParallelDims.group``:
"loss" for sums of tokens, "world" for agreement and maxima), so a sum can never silently count a
token once per tensor-parallel rank. Over a group of one rank (a one-process run) each helper
returns its answer without entering the backend: there is nothing to agree with.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _alone(group) -> bool:
    """The group is this rank only."""
    return dist.get_world_size(group) == 1


def dist_sum(tensor: torch.Tensor, group) -> torch.Tensor:
    """Sum ``tensor`` over the group, in place; returns it."""
    if _alone(group):
        return tensor
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def dist_max(value: float, device: torch.device, *, group) -> float:
    """The largest ``value`` over the group (e.g. the slowest rank's time, the largest peak memory)."""
    if _alone(group):
        return float(value)
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def dist_max_tensor(tensor: torch.Tensor, group) -> torch.Tensor:
    """Element-wise maximum of ``tensor`` over the group, in place (a minimum is the max of -x)."""
    if _alone(group):
        return tensor
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor


def dist_any(flag: bool, device: torch.device, *, group) -> bool:
    """True on every rank when it is true on any rank (one tiny all-reduce)."""
    if _alone(group):
        return bool(flag)
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def all_gather_objects(obj, *, group) -> list:
    """Every rank's picklable ``obj``, in rank order (small metadata only: it pickles)."""
    if _alone(group):
        return [obj]
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def all_gather_tensors(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's same-shaped ``tensor``, in rank order."""
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return parts


def broadcast_tensor(tensor: torch.Tensor, *, src: int, group) -> torch.Tensor:
    """``tensor`` as global rank ``src`` holds it, on every rank of the group, in place; returns it."""
    if _alone(group):
        return tensor
    dist.broadcast(tensor, src=src, group=group)
    return tensor


def all_to_all_counts(send: torch.Tensor, group) -> torch.Tensor:
    """``send`` [ranks, k] (row r: what goes to rank r) -> [ranks, k] (row r: what rank r sent here).

    Equal splits of k integers a rank; the token counts an uneven ``all_to_all`` is sized by."""
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send.contiguous(), group=group)
    return recv


class _AllToAll(torch.autograd.Function):
    """Rows to ranks with uneven splits; the backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, recv_splits: list[int], send_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (recv_splits, send_splits), group
        return _uneven_all_to_all(x, recv_splits, send_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        recv_splits, send_splits = ctx.splits
        return _uneven_all_to_all(grad, send_splits, recv_splits, ctx.group), None, None, None


def _uneven_all_to_all(x: torch.Tensor, recv_splits: list[int], send_splits: list[int], group) -> torch.Tensor:
    """``all_to_all_single`` with uneven splits. On gloo the blocks go as equal splits padded to
    the group's largest (one MAX all-reduce of one integer first): gloo's uneven path with empty
    blocks (an expert rank routed no token from a peer) aborted a rank once on another CPU, inside
    the next collective of the same group (a read of unexpected size), where equal splits are the
    path every other gloo collective here takes. NCCL takes the uneven splits as given."""
    if dist.get_backend(group) != "gloo":
        out = x.new_empty(sum(recv_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
        return out
    block = torch.tensor([max(recv_splits + send_splits)], dtype=torch.int64)
    dist.all_reduce(block, op=dist.ReduceOp.MAX, group=group)
    rows = max(1, int(block))
    ranks = len(send_splits)
    padded = x.new_zeros(ranks, rows, *x.shape[1:])
    for r, part in enumerate(torch.split(x.contiguous(), send_splits)):
        padded[r, : part.shape[0]] = part
    out = torch.empty_like(padded)
    dist.all_to_all_single(out, padded, group=group)
    return torch.cat([out[r, :n] for r, n in enumerate(recv_splits)])


def all_to_all_rows(x: torch.Tensor, *, recv_splits: list[int], send_splits: list[int], group) -> torch.Tensor:
    """Send ``send_splits[r]`` consecutive rows of ``x`` to rank r and receive ``recv_splits[r]`` from
    it, in rank order (differentiable: the gradient of what was received returns to its sender).
    Every rank's counts may differ: dynamic batching gives each rank its own token count."""
    return _AllToAll.apply(x, list(recv_splits), list(send_splits), group)
