"""Packed layout: each microbatch is ONE row holding its sequences back to back.

Positions restart at 0 for every sequence and attention stays inside a sequence, so a packed row
computes exactly what the same sequences compute as padded rows, without the padding. With CP
size c each sequence is padded to a multiple of 2c and cut into 2c chunks PER SEQUENCE; CP rank i
keeps chunks i and 2c-1-i of every sequence (Transformer Engine's THD layout, Megatron's packed
sequences). The row's total length is then rounded up to lcm(pad_to_multiple, 2c) (and to a
bucket edge when shapes are bucketed); that tail padding joins the last sequence. So a packed
microbatch costs roundup(sum(roundup(l_i, 2c)), m) / c tokens per GPU.

Planning is bin packing under the budget, balanced across DP ranks on modelled time:

1. Sequences that alone exceed the budget become singleton microbatches (counted, never dropped).
2. First-fit decreasing gives the least number of bins B it finds; every rank must run the same
   count, so K = ceil(B / dp) slots give K*dp bins.
3. Longest first, each sequence goes to the least loaded bin (in modelled time) that still fits
   (LPT): bins end up nearly equal, so each slot's slowest rank is close to its mean. When that
   fails to fit everything into K*dp bins, K+1 slots are tried, and plain FFD (unbalanced but
   fewest bins) competes too; the lowest modelled step time wins.
4. Bins are dealt into slots as in the padded planner: sorted by modelled time, dp at a time,
   the costliest of a slot to the least loaded rank. Spare bins are empty microbatches.

Everything is a deterministic function of the inputs: ties break on window position.

Cost: O(n log n) for n sequences. A bin fits while its summed segment length is at most one
capacity (``_capacity``: the row length never shrinks as the total grows, so "fits" is a
threshold), so first fit is the leftmost leaf of a max tree of remaining capacities that holds the
sequence, and "least loaded that fits" is a heap ordered by (modelled time, bin) popped until a bin
fits. Both choose exactly the bins the earlier scans over every open bin chose (the same plans,
tested against that scan), which took 2.0-3.2 s for 4,096 sequences and 73 s for 16,384.
"""

from __future__ import annotations

import heapq
import logging
import operator

from .args import PlanArgs
from .buckets import bucket_length
from .plan import EMPTY_MICROBATCH, Microbatch, StepPlan
from .pricing import round_up

log = logging.getLogger(__name__)


def segment_lengths(seq_lengths: list[int], cp_size: int, row_len: int) -> list[int]:
    """Per-sequence padded lengths of a packed row, in row order: each sequence rounded up to a
    multiple of 2*cp (exact at cp 1), the row's tail padding added to the last one. They sum to
    ``row_len`` (the microbatch's padded_len); every one is a multiple of 2*cp."""
    seg = 2 * cp_size if cp_size > 1 else 1
    out = [round_up(n, seg) for n in seq_lengths]
    tail = row_len - sum(out)
    if tail < 0 or tail % seg:
        raise ValueError(f"a packed row of {row_len} tokens cannot hold sequences {seq_lengths} at cp_size={cp_size}")
    if out:
        out[-1] += tail
    return out


def cp_ranges(segments: list[int], cp_size: int, cp_rank: int) -> list[tuple[int, int]]:
    """The [start, end) ranges of the packed row (global offsets) CP rank ``cp_rank`` holds, in
    its local order: for each sequence, its chunk cp_rank then its chunk 2*cp-1-cp_rank."""
    if cp_size == 1:
        return [(0, sum(segments))] if segments else []
    out, offset = [], 0
    for seg in segments:
        chunk = seg // (2 * cp_size)
        for j in (cp_rank, 2 * cp_size - 1 - cp_rank):
            out.append((offset + j * chunk, offset + (j + 1) * chunk))
        offset += seg
    return out


class _Pricer:
    """Row length, fit and modelled time of a packed bin from its summed segment lengths."""

    def __init__(self, args: PlanArgs) -> None:
        self.cp, self.multiple, self.budget = args.cut, args.multiple, args.budget()
        self.weight = args.attention_weight
        self.edges = sorted(round_up(int(e), self.multiple) for e in args.bucket_edges) if args.bucket_edges else None

    def row_len(self, total: int) -> int:
        row = round_up(total, self.multiple)
        return bucket_length(row, self.edges) if self.edges else row

    def fits(self, total: int) -> bool:
        return self.row_len(total) // self.cp <= self.budget

    def time(self, total: int, area: int) -> float:
        return self.row_len(total) // self.cp + (self.weight * area / self.cp if self.weight else 0)


def packed(lengths: list[int], args: PlanArgs) -> StepPlan:
    """Plan one window in the packed layout (see the module docstring); ``lengths`` already checked."""
    dp, cp = args.dp_size, args.cut
    price = _Pricer(args)
    seg_mult = args.segment_multiple
    seg = [round_up(n, seg_mult) for n in lengths]
    order = sorted(range(len(lengths)), key=seg.__getitem__, reverse=True)  # longest first; ties: window order
    capacity = _capacity(price)
    oversize = [i for i in order if seg[i] > capacity]
    rest = [i for i in order if seg[i] <= capacity]
    if oversize:
        log.warning(
            "%d sequence(s) exceed max_tokens_per_gpu=%d on their own (cp_size=%d); each runs as a "
            "singleton microbatch over the budget",
            len(oversize),
            price.budget,
            cp,
        )

    ffd = _first_fit_decreasing(rest, seg, capacity)
    slots = max(1, -(-(len(oversize) + len(ffd)) // dp))
    candidates = [ffd]
    for k in (slots, slots + 1):
        bins = _balanced(rest, seg, price, capacity, k * dp - len(oversize))
        if bins is not None:
            candidates.append(bins)
    best = None
    for bins in candidates:
        microbatches = [_microbatch(b, lengths, seg, price) for b in [*([i] for i in oversize), *bins] if b]
        ranks = _deal(microbatches, dp, price)
        plan = StepPlan.assemble(ranks, args, kind="dynamic", budgeted=True, oversize=len(oversize))
        key = (plan.modelled_step_time, plan.num_microbatches)
        if best is None or key < best[0]:
            best = (key, plan)
    return best[1]


def _capacity(price: _Pricer) -> int:
    """The largest summed segment length a bin may hold: ``price.fits(t)`` iff ``t <= capacity``.

    The row length (rounded up to the multiple, then to a bucket edge) never decreases as the
    total grows, so fitting is a threshold, found by bisection; a total of budget x cp + cp never
    fits (the row is at least the total)."""
    lo, hi = 0, price.budget * price.cp + price.cp
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if price.fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def _first_fit_decreasing(items: list[int], seg: list[int], capacity: int) -> list[list[int]]:
    """Each item (longest first) into the first bin with room, else a new bin.

    A max tree over bin slots holds each slot's remaining capacity; slots not yet opened hold the
    whole capacity, so the leftmost slot with room is either the first open bin with room or the
    next new one: first fit in O(log n) per item. A run of equal items is placed a bin at a time:
    after one goes into the leftmost bin with room, that bin stays the leftmost with room for the
    next while it has room, so as many as fit go there at once (RL windows repeat lengths: every
    response cut at the generation limit has the same one)."""
    # First fit leaves at most one bin half empty or emptier, so it opens at most 2 x total / capacity + 1 bins.
    bound = min(len(items), 2 * sum(seg[i] for i in items) // max(1, capacity) + 1)
    size = 1
    while size < max(1, bound):
        size *= 2
    tree = [capacity] * (2 * size)
    bins: list[list[int]] = []
    start, n = 0, len(items)
    while start < n:
        need = seg[items[start]]
        end = start + 1
        while end < n and seg[items[end]] == need:
            end += 1
        while start < end:
            if tree[1] < need:  # cannot happen (every item fits an empty bin, and the bound holds)
                raise RuntimeError(f"first fit: no bin slot of {size} holds {need} tokens (capacity {capacity})")
            node = 1
            while node < size:  # the leftmost leaf with room
                node *= 2
                if tree[node] < need:
                    node += 1
            b = node - size
            if b == len(bins):
                bins.append([])
            take = min(end - start, tree[node] // need)
            bins[b].extend(items[start : start + take])
            start += take
            tree[node] -= take * need
            node //= 2
            while node:  # the maxima above it, until one is unchanged
                best = max(tree[2 * node], tree[2 * node + 1])
                if tree[node] == best:
                    break
                tree[node] = best
                node //= 2
    return bins


def _balanced(items: list[int], seg: list[int], price: _Pricer, capacity: int, num_bins: int) -> list[list[int]] | None:
    """Longest first into the least loaded bin (modelled time, then bin index) that fits; None when
    one does not fit. A heap of (time, bin) is popped until a bin has room (the popped ones that
    had none go back): the bins a scan of every bin would choose, in O(log n) per item when time
    grows with the total (a bin that does not fit leaves only bins of the same time to try)."""
    if num_bins < 1:
        return None if items else []
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    totals, areas = [0] * num_bins, [0] * num_bins
    time = price.time
    tokens_only = not price.weight and not price.edges
    if tokens_only:  # the common case, inlined: the row's tokens per GPU
        m, cp = price.multiple, price.cp

        def time(total: int, _area: int) -> int:
            return -(-total // m) * m // cp

    heap = [(time(0, 0), b) for b in range(num_bins)]
    pop, push, replace = heapq.heappop, heapq.heappush, heapq.heapreplace
    if tokens_only:  # the same loop without areas or calls, until the least loaded bin is full
        for i in items:
            need = seg[i]
            b = heap[0][1]
            if totals[b] + need > capacity:
                break  # the general loop below takes over from this item
            total = totals[b] = totals[b] + need
            replace(heap, (-(-total // m) * m // cp, b))
            bins[b].append(i)
        else:
            return bins
        items = items[sum(len(members) for members in bins) :]  # areas stay 0: this time ignores them
    for i in items:
        need = seg[i]
        b = heap[0][1]
        if totals[b] + need <= capacity:  # the least loaded bin has room (the common case): one sift
            totals[b] += need
            areas[b] += need * need
            replace(heap, (time(totals[b], areas[b]), b))
        else:  # pop until a bin has room; the ones without go back
            full = [pop(heap)]
            while heap and totals[heap[0][1]] + need > capacity:
                full.append(pop(heap))
            if not heap:
                return None
            b = heap[0][1]
            totals[b] += need
            areas[b] += need * need
            replace(heap, (time(totals[b], areas[b]), b))
            for entry in full:
                push(heap, entry)
        bins[b].append(i)
    return bins


def _microbatch(indices: list[int], lengths: list[int], seg: list[int], price: _Pricer) -> Microbatch:
    indices = sorted(indices)  # row order: window order (any order is correct; this one is canonical)
    segments = [seg[i] for i in indices]
    total = sum(segments)
    row = price.row_len(total)
    segments[-1] += row - total  # the row's tail padding joins the last sequence
    return Microbatch(
        indices=tuple(indices),
        padded_len=row,
        cost=row // price.cp,
        tokens=sum(map(lengths.__getitem__, indices)),
        area=sum(map(operator.mul, segments, segments)),
        packed=True,
    )


def _deal(microbatches: list[Microbatch], dp: int, price: _Pricer) -> list[list[Microbatch]]:
    """Sorted by modelled time, dp at a time into slots; the costliest of a slot to the least loaded rank."""

    def time(mb: Microbatch) -> float:
        return mb.cost + (price.weight * mb.area / price.cp if price.weight else 0)

    microbatches = sorted(microbatches, key=lambda mb: (-time(mb), mb.indices))
    num_slots = max(1, -(-len(microbatches) // dp))
    microbatches.extend([EMPTY_MICROBATCH] * (num_slots * dp - len(microbatches)))
    ranks: list[list[Microbatch]] = [[] for _ in range(dp)]
    load = [0.0] * dp
    for slot in range(num_slots):
        chunk = microbatches[slot * dp : (slot + 1) * dp]
        for mb, rank in zip(chunk, sorted(range(dp), key=lambda r: (load[r], r))):
            ranks[rank].append(mb)
            load[rank] += time(mb)
    return ranks


def packed_fixed(lengths: list[int], groups: list[list[tuple[int, ...]]], args: PlanArgs) -> list[list[Microbatch]]:
    """The fixed planner's microbatches (per rank, lists of indices) as packed rows."""
    price = _Pricer.__new__(_Pricer)
    price.cp, price.multiple, price.weight = args.cut, args.multiple, args.attention_weight
    price.edges, price.budget = None, None
    seg = [round_up(n, args.segment_multiple) for n in lengths]
    return [[_microbatch(list(ix), lengths, seg, price) if ix else EMPTY_MICROBATCH for ix in rank] for rank in groups]
