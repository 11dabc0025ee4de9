"""Sort-and-stride greedy, the widely used dynamic-batching baseline the planner is measured against.

Sort the window by length, deal it round-robin to DP ranks, and grow each microbatch over
consecutive positions while rows * (the longest length at those positions on any rank, rounded
up to the pad multiple) / cp fits the budget. Every rank pads to that shared length.
"""

from __future__ import annotations

from .args import PlanArgs
from .plan import Microbatch, StepPlan, make_microbatch
from .pricing import microbatch_cost, round_up


def sort_and_stride(lengths: list[int], args: PlanArgs) -> StepPlan:
    dp, cp, multiple, budget = args.dp_size, args.cut, args.multiple, args.budget()
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
    return StepPlan.assemble(ranks, args, kind="sort_and_stride", budgeted=True, oversize=oversize)
