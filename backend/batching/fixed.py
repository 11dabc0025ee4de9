"""Fixed micro-batch size: the default, and the reference dynamic batching must match.

The window is dealt as Megatron does: microbatch slot j of DP rank r holds window positions
[(j*dp + r) * mbs, (j*dp + r + 1) * mbs). When the window does not fill the last slot on every
rank, the ranks that run short get a smaller or an empty microbatch, so all ranks still run the
same count. With ``layout="packed"`` each microbatch is one packed row of the same sequences.
"""

from __future__ import annotations

from .args import PlanArgs
from .packing import packed_fixed
from .plan import Microbatch, StepPlan, make_microbatch
from .pricing import round_up


def fixed(lengths: list[int], args: PlanArgs) -> StepPlan:
    dp, cp, multiple, mbs = args.dp_size, args.cut, args.multiple, args.mbs()
    num_slots = -(-len(lengths) // (dp * mbs))
    groups: list[list[tuple[int, ...]]] = [[] for _ in range(dp)]
    for slot in range(num_slots):
        for rank in range(dp):
            start = (slot * dp + rank) * mbs
            groups[rank].append(tuple(range(start, min(start + mbs, len(lengths)))))
    if args.layout == "packed":  # the same microbatches, each one packed row
        return StepPlan.assemble(packed_fixed(lengths, groups, args), args, kind=f"fixed_mbs{mbs}", budgeted=False)
    ranks: list[list[Microbatch]] = [[] for _ in range(dp)]
    for rank, rank_groups in enumerate(groups):
        for indices in rank_groups:
            padded_len = round_up(max(lengths[i] for i in indices), multiple) if indices else 0
            ranks[rank].append(make_microbatch(indices, padded_len, lengths, cp))
    return StepPlan.assemble(ranks, args, kind=f"fixed_mbs{mbs}", budgeted=False)
