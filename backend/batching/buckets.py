"""Shape bucketing: at most K distinct padded lengths, with edges chosen to lose least padding.

Every distinct padded length is a new shape for a compiler (FlexAttention under torch.compile
recompiles per shape; CUDA graphs capture per shape). Fixed multiples (pad_to_multiple=1024)
bound the shapes but waste padding where lengths are dense; here the K edges come from the
length distribution itself: an optimal 1-D partition of the sorted lengths that minimises the
total padded tokens sum(count * edge). Computed once from a sample of the data set's lengths,
so the whole run uses the same K shapes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from .pricing import round_up


def choose_bucket_edges(lengths: Sequence[int], max_shapes: int, multiple: int = 1) -> list[int]:
    """At most ``max_shapes`` edges (multiples of ``multiple``; the largest covers every length)
    minimising sum over sequences of (its bucket's edge), i.e. the padded tokens."""
    import numpy as np  # the planner core stays dependency-free; bucketing is optional

    if max_shapes < 1:
        raise ValueError(f"max_shapes must be >= 1, got {max_shapes}")
    counts = Counter(round_up(int(n), multiple) for n in lengths)
    if not counts:
        raise ValueError("lengths must not be empty")
    values = np.array(sorted(counts), dtype=np.float64)
    weights = np.array([counts[int(v)] for v in values], dtype=np.float64)
    d = len(values)
    if d <= max_shapes:
        return [int(v) for v in values]
    cum = np.concatenate([[0.0], np.cumsum(weights)])  # cum[j] = sequences with value index < j
    # best[k][j]: least padded tokens covering values[:j+1] with k+1 buckets, the last ending at j.
    best = np.full((max_shapes, d), np.inf)
    choice = np.zeros((max_shapes, d), dtype=np.int64)
    best[0] = cum[1:] * values
    for k in range(1, max_shapes):
        for j in range(k, d):
            # previous bucket ends at i in [k-1, j-1]; this bucket holds values i+1..j at edge values[j]
            i = np.arange(k - 1, j)
            cost = best[k - 1, k - 1 : j] + (cum[j + 1] - cum[i + 1]) * values[j]
            at = int(np.argmin(cost))
            best[k, j], choice[k, j] = cost[at], i[at]
    k = int(np.argmin(best[:, d - 1]))
    edges, j = [], d - 1
    while k >= 0:
        edges.append(int(values[j]))
        j = int(choice[k, j])
        k -= 1
    return sorted(edges)


def bucket_length(length: int, edges: Sequence[int]) -> int:
    """The smallest edge that holds ``length`` (edges sorted); above the last edge, the length itself."""
    lo, hi = 0, len(edges)
    while lo < hi:
        mid = (lo + hi) // 2
        if edges[mid] >= length:
            hi = mid
        else:
            lo = mid + 1
    return edges[lo] if lo < len(edges) else length
