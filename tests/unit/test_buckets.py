"""Shape bucketing: K edges from the length distribution, least padding, at most K shapes."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backend.batching import bucket_length, choose_bucket_edges, plan_dynamic, round_up
from backend.bench.length_sets import synthetic_lengths


def padded_total(lengths, edges):
    return sum(bucket_length(n, edges) for n in lengths)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 60), min_size=1, max_size=40), k=st.integers(1, 4), multiple=st.sampled_from([1, 4])
)
def test_edges_are_optimal_against_brute_force(lengths, k, multiple):
    edges = choose_bucket_edges(lengths, k, multiple)
    values = sorted({round_up(n, multiple) for n in lengths})
    assert len(edges) <= k and edges[-1] == values[-1] and all(e % multiple == 0 for e in edges)
    best = min(
        padded_total(lengths, sorted(set(c) | {values[-1]}))
        for r in range(0, min(k, len(values)))
        for c in itertools.combinations(values[:-1], r)
    )
    assert padded_total(lengths, edges) == best


def test_k8_keeps_rl_padding_efficiency_and_caps_shapes():
    edges = choose_bucket_edges(synthetic_lengths("rl_longtail", 20000, seed=1000), 8)
    seen = set()
    for step in range(4):
        lengths = synthetic_lengths("rl_longtail", 512, seed=step)
        plan = plan_dynamic(lengths, dp_size=8, max_tokens_per_gpu=16384, bucket_edges=edges)
        assert plan.covers(512)
        assert plan.padding_efficiency >= 0.85
        seen |= {mb.padded_len for r in plan.ranks for mb in r if mb.indices}
    assert len(seen) <= 8
    fixed_multiple = plan_dynamic(lengths, dp_size=8, max_tokens_per_gpu=16384, pad_to_multiple=1024)
    assert plan.padding_efficiency > fixed_multiple.padding_efficiency


def test_lengths_above_the_last_edge_keep_their_own_length():
    assert bucket_length(10, [4, 8]) == 10 and bucket_length(5, [4, 8]) == 8 and bucket_length(4, [4, 8]) == 4
    with pytest.raises(ValueError, match="max_shapes"):
        choose_bucket_edges([1, 2], 0)
