"""The O(n log n) packed planner chooses exactly the bins of the scans it replaced (every open bin
tried for every sequence), so its plans, and their quality, are the same on every window: random
windows with every knob (CP, pad multiple, bucket edges, attention weight) and the simulator's
length sets. ``_capacity`` is exactly the fit threshold."""

from __future__ import annotations

import numpy as np
import pytest

from backend.batching import PlanArgs, choose_bucket_edges
from backend.batching.packing import _balanced, _capacity, _first_fit_decreasing, _Pricer
from backend.batching.pricing import round_up
from backend.bench.length_sets import LENGTH_SETS, synthetic_lengths


def ffd_scan(items, seg, price):
    bins, totals = [], []
    for i in items:
        for b, total in enumerate(totals):
            if price.fits(total + seg[i]):
                bins[b].append(i)
                totals[b] += seg[i]
                break
        else:
            bins.append([i])
            totals.append(seg[i])
    return bins


def balanced_scan(items, seg, price, num_bins):
    if num_bins < 1:
        return None if items else []
    bins = [[] for _ in range(num_bins)]
    totals, areas = [0] * num_bins, [0] * num_bins
    for i in items:
        best, best_key = -1, None
        for b in range(num_bins):
            if price.fits(totals[b] + seg[i]):
                key = (price.time(totals[b], areas[b]), b)
                if best_key is None or key < best_key:
                    best, best_key = b, key
        if best < 0:
            return None
        bins[best].append(i)
        totals[best] += seg[i]
        areas[best] += seg[i] * seg[i]
    return bins


def _check(lengths, args):
    price = _Pricer(args)
    capacity = _capacity(price)
    for total in range(0, price.budget * price.cp + 2 * price.cp, max(1, price.budget // 97)):
        assert price.fits(total) == (total <= capacity)
    seg = [round_up(n, args.segment_multiple) for n in lengths]
    items = [i for i in sorted(range(len(seg)), key=lambda i: (-seg[i], i)) if seg[i] <= capacity]
    ffd = _first_fit_decreasing(items, seg, capacity)
    assert ffd == ffd_scan(items, seg, price)
    slots = -(-len(ffd) // args.dp_size)
    for k in (slots - 1, slots, slots + 1):
        num_bins = k * args.dp_size
        assert _balanced(items, seg, price, capacity, num_bins) == balanced_scan(items, seg, price, num_bins)


@pytest.mark.parametrize("seed", range(40))
def test_same_bins_as_the_scans_on_random_windows(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 250))
    lengths = np.maximum(rng.lognormal(5, 1.2, n).astype(int), 1).tolist()
    pad, cp = int(rng.choice([1, 8, 64])), int(rng.choice([1, 2, 4]))
    args = PlanArgs(
        dp_size=int(rng.integers(1, 9)),
        cp_size=cp,
        max_tokens_per_gpu=int(rng.choice([512, 1024, 4096])),
        pad_to_multiple=pad,
        layout="packed",
        attention_weight=float(rng.choice([0.0, 1e-4, 2e-3])),
        bucket_edges=choose_bucket_edges(lengths, 4, pad) if seed % 3 == 0 else None,
    )
    _check(lengths, args)


@pytest.mark.parametrize("name", sorted(LENGTH_SETS))
@pytest.mark.parametrize("cp", [1, 2])
def test_same_bins_as_the_scans_on_the_simulator_sets(name, cp):
    lengths = synthetic_lengths(name, 512, seed=3)
    _check(lengths, PlanArgs(dp_size=8, cp_size=cp, max_tokens_per_gpu=16384, layout="packed"))
