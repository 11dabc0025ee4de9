"""Dynamic batching: group one window's sequences into per-rank microbatches under a token budget.

The plan minimises the modelled step time (``StepPlan.modelled_step_time``): the sum over
microbatch slots of the slowest rank's modelled time (its priced cost in tokens plus
attention_weight * rows * L^2 / cp), plus a fixed overhead per slot. The budget stays a memory
bound in tokens. In four steps:

1. Sort the window by padded length, longest first, so each microbatch holds neighbours in length
   and pads little.
2. Cut the sorted order into groups under the budget. Two cuts are tried: "fill" (as many rows as
   fit) and "ratio" (the cut with the lowest (cost + overhead) / real tokens, which stops a group
   of long rows from dragging a few short ones up to its length). The better plan wins.
3. Every rank must run the same count K = ceil(groups / dp). The K*dp - groups spare places are
   filled by halving the most expensive multi-row groups (which only lowers costs); places still
   spare become empty microbatches on the ranks that lack sequences.
4. Sort groups by cost and deal them dp at a time into slots, so each slot holds groups of similar
   cost (this ordering minimises the sum of slot maxima for a fixed set of groups); inside a slot
   the most expensive group goes to the least loaded rank, which keeps rank totals even.

``layout="packed"`` plans one packed row per microbatch instead (``packing.py``).

A sequence that alone exceeds the budget becomes a singleton microbatch and is counted, never
dropped. Everything is a deterministic function of the inputs: ties break on window position.
"""

from __future__ import annotations

import heapq
import logging

from .args import PlanArgs
from .buckets import bucket_length
from .packing import packed
from .plan import EMPTY_MICROBATCH, Microbatch, StepPlan
from .pricing import attention_area, microbatch_cost, round_up

log = logging.getLogger(__name__)


def dynamic(lengths: list[int], args: PlanArgs) -> StepPlan:
    """Plan one optimizer window (see the module docstring); ``lengths`` already checked.

    ``args.bucket_edges`` (from ``choose_bucket_edges``) pads every row up to the smallest edge
    that holds it, so plans use at most len(edges) distinct lengths (a length above the last edge
    keeps its own CP-aligned length).
    """
    dp, cp, multiple, overhead, bucket_edges = (
        args.dp_size,
        args.cut,
        args.multiple,
        args.overhead,
        args.bucket_edges,
    )
    if args.layout == "packed":
        return packed(lengths, args)
    budget = args.budget()
    weight = args.attention_weight

    # Longest first; padded length is monotone in length, and a stable sort breaks ties on position.
    order = sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True)
    sorted_lengths = [lengths[i] for i in order]
    sorted_padded = [round_up(n, multiple) for n in sorted_lengths]
    if bucket_edges:
        edges = sorted(round_up(int(e), multiple) for e in bucket_edges)
        sorted_padded = [bucket_length(p, edges) for p in sorted_padded]
    prefix = [0]
    for n in sorted_lengths:
        prefix.append(prefix[-1] + n)

    oversize = sum(1 for p in sorted_padded if microbatch_cost(1, p, cp) > budget)
    if oversize:
        log.warning(
            "%d sequence(s) exceed max_tokens_per_gpu=%d on their own (cp_size=%d); each runs as a "
            "singleton microbatch over the budget",
            oversize,
            budget,
            cp,
        )

    best = None
    for cut in (_cut_fill, _cut_ratio):
        groups = _fill_spare_places(
            cut(sorted_padded, sorted_lengths, cp, budget, overhead, weight), sorted_padded, cp, dp, weight
        )
        num_slots = -(-len(groups) // dp)
        # groups are most expensive first, so each slot's maximum is its first group.
        step_time = sum(-groups[j * dp][0] for j in range(num_slots)) + overhead * num_slots
        padded_tokens = sum((e - s) * sorted_padded[s] for _, s, e in groups)
        key = (step_time, -prefix[-1] / padded_tokens)
        if best is None or key < best[0]:
            best = (key, groups)
    return _assemble(best[1], order, sorted_padded, prefix, args, oversize)


def _time(rows: int, padded_len: int, cp: int, weight: float) -> float:
    """Modelled compute of a padded microbatch: tokens per GPU plus weight * rows * L^2 / cp."""
    cost = microbatch_cost(rows, padded_len, cp)
    return cost + weight * attention_area(rows, padded_len) / cp if weight else cost


def _row_cap(padded_len: int, cp: int, budget: int) -> int:
    """Rows of this padded length that fit the budget (at least 1: an oversize singleton)."""
    return max(1, budget // microbatch_cost(1, padded_len, cp))


def _cut_fill(sorted_padded, sorted_lengths, cp, budget, overhead, weight) -> list[tuple[int, int]]:
    """Groups [start, end) of the sorted order, each as full as the budget allows."""
    groups, start, n = [], 0, len(sorted_padded)
    while start < n:
        end = min(n, start + _row_cap(sorted_padded[start], cp, budget))
        groups.append((start, end))
        start = end
    return groups


def _cut_ratio(sorted_padded, sorted_lengths, cp, budget, overhead, weight) -> list[tuple[int, int]]:
    """Groups whose (cost + overhead) per real token is lowest among the cuts that fit."""
    groups, start, n = [], 0, len(sorted_padded)
    while start < n:
        per_row = _time(1, sorted_padded[start], cp, weight)
        last = min(n, start + _row_cap(sorted_padded[start], cp, budget))
        real, best_end, best_score = 0, start + 1, None
        for end in range(start + 1, last + 1):
            real += sorted_lengths[end - 1]
            # Compare (rows * per_row + overhead) / real without division; ties keep the longer group.
            score_num, score_den = (end - start) * per_row + overhead, real
            if best_score is None or score_num * best_score[1] <= best_score[0] * score_den:
                best_score, best_end = (score_num, score_den), end
        groups.append((start, best_end))
        start = best_end
    return groups


def _best_split(start: int, end: int, sorted_padded, cp, weight) -> int:
    """Split point of [start, end) that minimises the costlier half (rows stay length-sorted)."""
    best_mid, best_key = start + 1, None
    for mid in range(start + 1, end):
        a = _time(mid - start, sorted_padded[start], cp, weight)
        b = _time(end - mid, sorted_padded[mid], cp, weight)
        key = (max(a, b), abs(a - b))
        if best_key is None or key < best_key:
            best_key, best_mid = key, mid
    return best_mid


def _fill_spare_places(groups, sorted_padded, cp, dp, weight) -> list[tuple[float, int, int]]:
    """Halve the most expensive multi-row groups until the group count is a multiple of dp.

    Returns (-time, start, end) most expensive first (time: ``_time``, the cost when weight is 0): a total, deterministic order.
    """
    spare = -(-len(groups) // dp) * dp - len(groups)
    heap = [(-_time(e - s, sorted_padded[s], cp, weight), s, e) for s, e in groups]
    heapq.heapify(heap)
    singles = []
    while spare and heap:
        neg_cost, s, e = heapq.heappop(heap)
        if e - s < 2:
            singles.append((neg_cost, s, e))
            continue
        mid = _best_split(s, e, sorted_padded, cp, weight)
        heapq.heappush(heap, (-_time(mid - s, sorted_padded[s], cp, weight), s, mid))
        heapq.heappush(heap, (-_time(e - mid, sorted_padded[mid], cp, weight), mid, e))
        spare -= 1
    return sorted(heap + singles)


def _assemble(groups, order, sorted_padded, prefix, args: PlanArgs, oversize: int) -> StepPlan:
    """Deal the groups dp at a time into slots; the costliest of a slot to the least loaded rank."""
    cp = args.cut
    microbatches = [
        Microbatch(
            indices=tuple(order[s:e]),
            padded_len=sorted_padded[s],
            cost=microbatch_cost(e - s, sorted_padded[s], cp),
            tokens=prefix[e] - prefix[s],
            area=attention_area(e - s, sorted_padded[s]),
        )
        for _, s, e in groups
    ]
    times = [-neg_time for neg_time, _, _ in groups]
    times += [0] * (-(-len(groups) // args.dp_size) * args.dp_size - len(groups))
    dp = args.dp_size
    num_slots = -(-len(microbatches) // dp)
    microbatches.extend([EMPTY_MICROBATCH] * (num_slots * dp - len(microbatches)))
    ranks: list[list[Microbatch]] = [[] for _ in range(dp)]
    load = [0] * dp
    for slot in range(num_slots):
        chunk = range(slot * dp, (slot + 1) * dp)
        for j, rank in zip(chunk, sorted(range(dp), key=lambda r: (load[r], r))):
            ranks[rank].append(microbatches[j])
            load[rank] += times[j]
    return StepPlan.assemble(ranks, args, kind="dynamic", budgeted=True, oversize=oversize)
