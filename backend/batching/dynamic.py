"""Dynamic batching: group one window's sequences into per-rank microbatches under a token budget.

The plan minimises the modelled step time (``StepPlan.modelled_step_time``): the sum over
microbatch slots of the slowest rank's priced cost, plus a fixed overhead per slot. In four steps:

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

A sequence that alone exceeds the budget becomes a singleton microbatch and is counted, never
dropped. Everything is a deterministic function of the inputs: ties break on window position.
"""

from __future__ import annotations

import heapq
import logging

from .args import PlanArgs
from .buckets import bucket_length
from .plan import EMPTY_MICROBATCH, Microbatch, StepPlan
from .pricing import microbatch_cost, round_up

log = logging.getLogger(__name__)


def dynamic(lengths: list[int], args: PlanArgs) -> StepPlan:
    """Plan one optimizer window (see the module docstring); ``lengths`` already checked.

    ``args.bucket_edges`` (from ``choose_bucket_edges``) pads every row up to the smallest edge
    that holds it, so plans use at most len(edges) distinct lengths (a length above the last edge
    keeps its own CP-aligned length).
    """
    dp, cp, multiple, overhead, bucket_edges = (
        args.dp_size,
        args.cp_size,
        args.multiple,
        args.overhead,
        args.bucket_edges,
    )
    budget = args.budget()

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
        groups = _fill_spare_places(cut(sorted_padded, sorted_lengths, cp, budget, overhead), sorted_padded, cp, dp)
        num_slots = -(-len(groups) // dp)
        # groups are most expensive first, so each slot's maximum is its first group.
        step_time = sum(-groups[j * dp][0] for j in range(num_slots)) + overhead * num_slots
        padded_tokens = sum((e - s) * sorted_padded[s] for _, s, e in groups)
        key = (step_time, -prefix[-1] / padded_tokens)
        if best is None or key < best[0]:
            best = (key, groups)
    return _assemble(best[1], order, sorted_padded, prefix, args, oversize)


def _row_cap(padded_len: int, cp: int, budget: int) -> int:
    """Rows of this padded length that fit the budget (at least 1: an oversize singleton)."""
    return max(1, budget // microbatch_cost(1, padded_len, cp))


def _cut_fill(sorted_padded, sorted_lengths, cp, budget, overhead) -> list[tuple[int, int]]:
    """Groups [start, end) of the sorted order, each as full as the budget allows."""
    groups, start, n = [], 0, len(sorted_padded)
    while start < n:
        end = min(n, start + _row_cap(sorted_padded[start], cp, budget))
        groups.append((start, end))
        start = end
    return groups


def _cut_ratio(sorted_padded, sorted_lengths, cp, budget, overhead) -> list[tuple[int, int]]:
    """Groups whose (cost + overhead) per real token is lowest among the cuts that fit."""
    groups, start, n = [], 0, len(sorted_padded)
    while start < n:
        per_row = microbatch_cost(1, sorted_padded[start], cp)
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


def _best_split(start: int, end: int, sorted_padded, cp) -> int:
    """Split point of [start, end) that minimises the costlier half (rows stay length-sorted)."""
    best_mid, best_key = start + 1, None
    for mid in range(start + 1, end):
        a = microbatch_cost(mid - start, sorted_padded[start], cp)
        b = microbatch_cost(end - mid, sorted_padded[mid], cp)
        key = (max(a, b), abs(a - b))
        if best_key is None or key < best_key:
            best_key, best_mid = key, mid
    return best_mid


def _fill_spare_places(groups, sorted_padded, cp, dp) -> list[tuple[int, int, int]]:
    """Halve the most expensive multi-row groups until the group count is a multiple of dp.

    Returns (-cost, start, end) most expensive first: a total, deterministic order.
    """
    spare = -(-len(groups) // dp) * dp - len(groups)
    heap = [(-microbatch_cost(e - s, sorted_padded[s], cp), s, e) for s, e in groups]
    heapq.heapify(heap)
    singles = []
    while spare and heap:
        neg_cost, s, e = heapq.heappop(heap)
        if e - s < 2:
            singles.append((neg_cost, s, e))
            continue
        mid = _best_split(s, e, sorted_padded, cp)
        heapq.heappush(heap, (-microbatch_cost(mid - s, sorted_padded[s], cp), s, mid))
        heapq.heappush(heap, (-microbatch_cost(e - mid, sorted_padded[mid], cp), mid, e))
        spare -= 1
    return sorted(heap + singles)


def _assemble(groups, order, sorted_padded, prefix, args: PlanArgs, oversize: int) -> StepPlan:
    """Deal the groups dp at a time into slots; the costliest of a slot to the least loaded rank."""
    microbatches = [
        Microbatch(indices=tuple(order[s:e]), padded_len=sorted_padded[s], cost=-neg_cost, tokens=prefix[e] - prefix[s])
        for neg_cost, s, e in groups
    ]
    dp = args.dp_size
    num_slots = -(-len(microbatches) // dp)
    microbatches.extend([EMPTY_MICROBATCH] * (num_slots * dp - len(microbatches)))
    ranks: list[list[Microbatch]] = [[] for _ in range(dp)]
    load = [0] * dp
    for slot in range(num_slots):
        chunk = microbatches[slot * dp : (slot + 1) * dp]
        for mb, rank in zip(chunk, sorted(range(dp), key=lambda r: (load[r], r))):
            ranks[rank].append(mb)
            load[rank] += mb.cost
    return StepPlan.assemble(ranks, args, kind="dynamic", budgeted=True, oversize=oversize)
