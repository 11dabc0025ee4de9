"""Sort-and-stride greedy, the widely used dynamic-batching baseline the planner is measured against.

Sort the window by length, deal it round-robin to DP ranks, and grow each microbatch over
consecutive positions while rows * (the longest length at those positions on any rank, rounded
up to the pad multiple) / cp fits the budget. Every rank pads to that shared length.
"""

from __future__ import annotations

from collections.abc import Sequence

from .plan import DEFAULT_MICROBATCH_OVERHEAD, Microbatch, StepPlan, make_microbatch
from .pricing import check_budget, check_plan_args, microbatch_cost, round_up


def plan_sort_and_stride(
    lengths: Sequence[int],
    *,
    dp_size: int,
    cp_size: int = 1,
    max_tokens_per_gpu: int,
    pad_to_multiple: int = 1,
    overhead: int = DEFAULT_MICROBATCH_OVERHEAD,
) -> StepPlan:
    lengths, dp, cp, multiple = check_plan_args(lengths, dp_size, cp_size, pad_to_multiple, overhead)
    budget = check_budget(max_tokens_per_gpu, multiple, cp)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    per_rank = [order[r::dp] for r in range(dp)]
    depth = len(per_rank[0])  # rank 0 holds the most (and the longest at every position)
    ranks: list[list[Microbatch]] = [[] for _ in range(dp)]
    pos = 0
    while pos < depth:
        shared_len = round_up(lengths[per_rank[0][pos]], multiple)
        rows = max(1, budget // microbatch_cost(1, shared_len, cp))
        end = min(depth, pos + rows)
        for r in range(dp):
            ranks[r].append(make_microbatch(tuple(per_rank[r][pos:end]), shared_len, lengths, cp))
        pos = end
    oversize = sum(1 for n in lengths if microbatch_cost(1, round_up(n, multiple), cp) > budget)
    return StepPlan(
        ranks=tuple(tuple(r) for r in ranks),
        cp_size=cp,
        max_tokens_per_gpu=budget,
        pad_multiple=multiple,
        oversize_singletons=oversize,
        kind="sort_and_stride",
        overhead=overhead,
    )
