"""Fixed micro-batch size: the default, and the reference dynamic batching must match.

The window is dealt as Megatron does: microbatch slot j of DP rank r holds window positions
[(j*dp + r) * mbs, (j*dp + r + 1) * mbs). When the window does not fill the last slot on every
rank, the ranks that run short get a smaller or an empty microbatch, so all ranks still run the
same count.
"""

from __future__ import annotations

from collections.abc import Sequence

from .plan import DEFAULT_MICROBATCH_OVERHEAD, Microbatch, StepPlan, make_microbatch
from .pricing import check_plan_args, check_positive_int, round_up


def plan_fixed(
    lengths: Sequence[int],
    *,
    dp_size: int,
    cp_size: int = 1,
    micro_batch_size: int,
    pad_to_multiple: int = 1,
    overhead: int = DEFAULT_MICROBATCH_OVERHEAD,
) -> StepPlan:
    lengths, dp, cp, multiple = check_plan_args(lengths, dp_size, cp_size, pad_to_multiple, overhead)
    mbs = check_positive_int("micro_batch_size", micro_batch_size)
    num_slots = -(-len(lengths) // (dp * mbs))
    ranks: list[list[Microbatch]] = [[] for _ in range(dp)]
    for slot in range(num_slots):
        for rank in range(dp):
            start = (slot * dp + rank) * mbs
            indices = tuple(range(start, min(start + mbs, len(lengths))))
            padded_len = round_up(max(lengths[i] for i in indices), multiple) if indices else 0
            ranks[rank].append(make_microbatch(indices, padded_len, lengths, cp))
    return StepPlan(
        ranks=tuple(tuple(r) for r in ranks),
        cp_size=cp,
        max_tokens_per_gpu=None,
        pad_multiple=multiple,
        kind=f"fixed_mbs{mbs}",
        overhead=overhead,
    )
