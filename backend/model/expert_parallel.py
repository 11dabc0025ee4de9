"""Expert parallelism: each MoE layer's experts split over an EP group, tokens sent to them and back.

Placement (``place_experts``, before FSDP2 wraps the model): a stacked expert tensor [E, ...]
becomes a DTensor sharded on dim 0 over the EP mesh dimension, so EP rank j holds experts
[j E/EP, (j + 1) E/EP) and never the others; FSDP2 then shards those over the ``expert_dp``
dimension (the world / EP ranks owning the same experts), as torchtitan composes EP with FSDP2.
Checkpoints and exports see the global [E, ...] tensor (each expert once), so any EP size reads
them. At GPT-OSS-20B's 32 experts of 3 x 2880 x 5760 weights a layer, EP 8 keeps 4 experts a
rank in memory during the layer's forward and backward where FSDP2 alone gathers all 32
(1.6 GB of BF16 a layer): the gathered bytes drop by 8x and the tokens travel instead.

Exchange (``exchange_and_run``, called by the experts module on every forward): megatron-core's
allgather dispatcher (its own expert parallel size stays 1) hands over this rank's routed tokens
sorted by global expert, ``counts[e]`` of them for expert e. Experts of one EP rank are
consecutive, so the tokens for EP rank j are one contiguous block. One all-to-all of the [EP,
E/EP] counts tells every rank how many rows each source sends for each of its experts (their
totals differ per rank: dynamic batching gives every rank its own token count); the rows and
their routing probabilities follow with uneven all-to-alls, are regrouped expert-major for the
grouped GEMMs, and return the same way. Autograd sends the gradients back along the same routes,
so each expert's weight gradient sums every token routed to it in the EP group; FSDP2 then
reduce-scatters it over ``expert_dp``. Per MoE layer and microbatch that is 2 all-to-alls of
k x tokens x hidden (forward) and 2 more in the backward, against FSDP2's all-gather and
reduce-scatter of the whole layer's experts.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from backend.distributed.collectives import all_to_all_counts, all_to_all_rows

from .moe_stats import stats_of

#: The stacked per-expert parameters of ``GroupedExperts`` (dim 0 is the expert).
EXPERT_PARAMS = ("fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias")


def expert_major_order(recv: torch.Tensor) -> torch.Tensor:
    """Rows received source-major ([ep, el] counts: source s, its rows for local expert j) ->
    the permutation that lists them expert-major (expert j's rows from source 0, 1, ...)."""
    ep, el = recv.shape
    flat = recv.reshape(-1)
    starts = (torch.cumsum(flat, 0) - flat).view(ep, el).t().reshape(-1)  # each (j, s) block's start
    lens = recv.t().reshape(-1)
    total = int(flat.sum())
    out_starts = torch.cumsum(lens, 0) - lens
    shift = torch.repeat_interleave(starts - out_starts, lens, output_size=total)
    return shift + torch.arange(total, dtype=shift.dtype)


def exchange_and_run(
    tokens: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    probs: torch.Tensor,
    run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    group,
    ep: int,
) -> torch.Tensor:
    """Send ``tokens`` (sorted by global expert) to the ranks owning their experts, apply ``run``
    (the local experts on rows sorted by local expert: ``run(x, counts, probs)``) and bring the
    outputs back in the input's order."""
    counts = tokens_per_expert.to(torch.long).cpu()
    el = counts.numel() // ep
    send = counts.view(ep, el)
    recv = all_to_all_counts(send.to(tokens.device), group).cpu()
    send_splits, recv_splits = send.sum(1).tolist(), recv.sum(1).tolist()
    x = all_to_all_rows(tokens, recv_splits=recv_splits, send_splits=send_splits, group=group)
    p = all_to_all_rows(probs, recv_splits=recv_splits, send_splits=send_splits, group=group)
    order = expert_major_order(recv)
    inverse = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel()))
    order, inverse = order.to(tokens.device), inverse.to(tokens.device)
    y = run(x.index_select(0, order), recv.sum(0), p.index_select(0, order))
    return all_to_all_rows(y.index_select(0, inverse), recv_splits=send_splits, send_splits=recv_splits, group=group)


def experts_held(module: torch.nn.Module) -> int:
    """Experts an experts module computes with on this rank, read from its weight as it is now
    (inside its forward, after FSDP2 unsharded it): E at EP 1, E / EP under expert parallelism."""
    weight = module.fc1_weight
    return int((weight.to_local() if hasattr(weight, "to_local") else weight).shape[0])


def place_experts(model: torch.nn.Module, env) -> list[torch.nn.Module]:
    """Keep this rank's experts of every MoE layer (a DTensor slice on the EP mesh dimension) and
    give each experts module its exchange; returns the modules (FSDP2 shards each over
    ``expert_dp``). A model on the meta device stays there. No-op at EP 1."""
    if env.ep_size == 1:
        return []
    from torch.distributed.tensor import DTensor, Shard

    from .grouped_experts import grouped_experts_class

    cls, mesh = grouped_experts_class(), env.dims.mesh("ep")
    modules = [m for m in model.modules() if isinstance(m, cls)]
    for module in modules:
        e = module.num_local_experts
        if e % env.ep_size:
            raise ValueError(f"parallel.expert_parallel_size={env.ep_size}: must divide the {e} experts of a layer")
        el = e // env.ep_size
        start = env.ep_rank * el
        for name in EXPERT_PARAMS:
            full = getattr(module, name)
            local = full.detach()[start : start + el].clone()
            shard = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride())
            setattr(module, name, torch.nn.Parameter(shard, requires_grad=full.requires_grad))
        module.experts_per_rank = el
        module.exchange = functools.partial(exchange_and_run, group=env.ep_group, ep=env.ep_size)
    stats = stats_of(model)
    if stats is not None:
        stats.ep_size = env.ep_size
    return modules
