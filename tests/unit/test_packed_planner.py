"""The packed layout's planner contract and the attention-aware time model, as properties over random windows."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backend.batching import (
    PlanArgs,
    choose_bucket_edges,
    cp_ranges,
    plan_dynamic,
    plan_fixed,
    round_up,
    segment_lengths,
)
from backend.bench.length_sets import LENGTH_SETS, synthetic_lengths

from .test_planner import pad_mult


def check_packed_invariants(plan, lengths, *, dp, cp, budget, pad, edges=None):
    m = pad_mult(pad, cp)
    seg = 2 * cp if cp > 1 else 1
    d = plan.to_dict()
    assert len(d["ranks"]) == dp
    assert {len(r) for r in d["ranks"]} == {d["num_microbatches"]}, "same count on every DP rank"
    seen = sorted(i for r in d["ranks"] for mb in r for i in mb["indices"])
    assert seen == list(range(len(lengths))), "every sample exactly once"
    oversize = 0
    for rank in d["ranks"]:
        for mb in rank:
            idx = mb["indices"]
            if not idx:
                assert mb == {"indices": [], "padded_len": 0, "cost": 0, "tokens": 0}
                continue
            assert mb["layout"] == "packed"
            total = sum(round_up(lengths[i], seg) for i in idx)
            row = round_up(total, m)
            if edges is None:
                assert mb["padded_len"] == row, "the row's total length, per-sequence CP alignment included"
            else:
                assert mb["padded_len"] in edges or (mb["padded_len"] == row and row > max(edges))
            assert mb["padded_len"] % m == 0
            assert mb["cost"] == mb["padded_len"] // cp
            assert mb["tokens"] == sum(lengths[i] for i in idx)
            segs = segment_lengths([lengths[i] for i in idx], cp, mb["padded_len"])
            assert sum(segs) == mb["padded_len"] and all(s % seg == 0 for s in segs)
            if len(idx) >= 2:
                assert mb["cost"] <= budget, "multi-sequence microbatches stay under the budget"
            elif mb["cost"] > budget:
                oversize += 1
    if edges is None:
        assert oversize == plan.oversize_singletons == sum(1 for n in lengths if round_up(n, m) // cp > budget)
    assert plan.layout == "packed" and d["layout"] == "packed"
    assert 0 < plan.padding_efficiency <= 1
    json.dumps(d)


windows = st.lists(st.integers(min_value=1, max_value=5000), min_size=1, max_size=200)


@settings(max_examples=200, deadline=None)
@given(
    lengths=windows,
    dp=st.integers(1, 12),
    cp=st.integers(1, 4),
    pad=st.sampled_from([1, 1, 2, 8, 64]),
    budget=st.integers(1, 30000),
    weight=st.sampled_from([0.0, 0.0, 1e-3, 0.05]),
)
def test_packed_plan_invariants(lengths, dp, cp, pad, budget, weight):
    kw = dict(dp_size=dp, cp_size=cp, max_tokens_per_gpu=budget, pad_to_multiple=pad, layout="packed")
    if budget < pad_mult(pad, cp) // cp:
        with pytest.raises(ValueError, match="max_tokens_per_gpu"):
            plan_dynamic(lengths, **kw)
        return
    plan = plan_dynamic(lengths, attention_weight=weight, **kw)
    check_packed_invariants(plan, lengths, dp=dp, cp=cp, budget=budget, pad=pad)
    again = plan_dynamic(list(lengths), attention_weight=weight, **kw)
    assert again.to_dict() == plan.to_dict() and again.fingerprint == plan.fingerprint


@settings(max_examples=60, deadline=None)
@given(lengths=windows, dp=st.integers(1, 8), cp=st.integers(1, 4), k=st.integers(1, 6))
def test_packed_rows_follow_bucket_edges(lengths, dp, cp, k):
    m = pad_mult(1, cp)
    edges = choose_bucket_edges([n * 4 for n in lengths], k, m)
    budget = 2 * max(edges)
    plan = plan_dynamic(lengths, dp_size=dp, cp_size=cp, max_tokens_per_gpu=budget, layout="packed", bucket_edges=edges)
    check_packed_invariants(plan, lengths, dp=dp, cp=cp, budget=budget, pad=1, edges=edges)


def test_packed_fingerprint_differs_from_padded_and_empty_microbatches():
    padded = plan_dynamic([5], dp_size=1, max_tokens_per_gpu=64)
    packed = plan_dynamic([5], dp_size=1, max_tokens_per_gpu=64, layout="packed")
    assert padded.fingerprint != packed.fingerprint
    plan = plan_dynamic([5, 300, 7], dp_size=8, max_tokens_per_gpu=1024, layout="packed")
    assert plan.num_microbatches == 1 and plan.covers(3)
    assert plan.empty_microbatches == 5  # spread over three ranks: the slot lasts as long as the longest
    plan = plan_dynamic([5000, 4097, 9000, 30, 40], dp_size=2, max_tokens_per_gpu=4096, layout="packed")
    assert plan.oversize_singletons == 3 and plan.covers(5)


def test_packed_cp_pricing_per_sequence():
    # Each sequence pads to a multiple of 2c = 4 on its own: 1001 -> 1004, 3 -> 4; the row is 1008 long.
    plan = plan_dynamic([1001, 3], dp_size=1, cp_size=2, max_tokens_per_gpu=1000, layout="packed")
    (mb,) = plan.ranks[0]
    assert mb.padded_len == 1008 and mb.cost == 504 and mb.packed
    assert segment_lengths([1001, 3], 2, 1008) == [1004, 4]
    assert segment_lengths([1001, 3], 2, 1016) == [1004, 12]  # a bucketed tail joins the last sequence
    with pytest.raises(ValueError):
        segment_lengths([1001, 3], 2, 1000)


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_cp_ranges_partition_every_sequence_in_chunk_order(cp):
    segs = [4 * cp, 2 * cp, 6 * cp] if cp > 1 else [5, 1, 7]
    total = sum(segs)
    parts = [cp_ranges(segs, cp, r) for r in range(cp)]
    covered = sorted(t for p in parts for s, e in p for t in range(s, e))
    assert covered == list(range(total))
    for r, p in enumerate(parts):
        assert sum(e - s for s, e in p) == total // cp  # each CP rank holds 1/c of every sequence
        if cp > 1:  # sequence 0's chunks r and 2c-1-r
            chunk = segs[0] // (2 * cp)
            assert p[0] == (r * chunk, (r + 1) * chunk) and p[1] == ((2 * cp - 1 - r) * chunk, (2 * cp - r) * chunk)


@pytest.mark.parametrize("name", LENGTH_SETS)
@pytest.mark.parametrize("cp", [1, 2])
def test_packed_padding_efficiency_and_step_time(name, cp):
    for step in range(2):
        lengths = synthetic_lengths(name, 512, seed=step)
        kw = dict(dp_size=8, cp_size=cp, max_tokens_per_gpu=16384)
        packed = plan_dynamic(lengths, layout="packed", **kw)
        padded = plan_dynamic(lengths, **kw)
        check_packed_invariants(packed, lengths, dp=8, cp=cp, budget=16384, pad=1)
        assert packed.padding_efficiency >= (0.99 if cp == 1 else 0.98)
        assert packed.modelled_step_time <= padded.modelled_step_time


def test_fixed_plan_packed_layout_keeps_megatron_dealing():
    lengths = [7, 3, 9, 1, 12, 5, 2]
    padded = plan_fixed(lengths, dp_size=2, micro_batch_size=2)
    packed = plan_fixed(lengths, dp_size=2, cp_size=2, micro_batch_size=2, layout="packed")
    assert [[mb.indices for mb in r] for r in padded.ranks] == [[mb.indices for mb in r] for r in packed.ranks]
    first = packed.ranks[0][0]
    assert first.packed and first.padded_len == round_up(7, 4) + round_up(3, 4)


def test_attention_weight_prices_long_rows_and_balances_ranks():
    lengths = [4096] * 2 + [256] * 64
    flat = plan_dynamic(lengths, dp_size=2, max_tokens_per_gpu=8192, layout="packed")
    aware = plan_dynamic(lengths, dp_size=2, max_tokens_per_gpu=8192, layout="packed", attention_weight=0.01)
    # Under attention-aware pricing the two long sequences' rows are costlier than their tokens:
    # their rank gets fewer short sequences.
    assert aware.rank_imbalance <= 0.05
    rescored = type(flat)(**{**vars(flat), "attention_weight": 0.01, "_fingerprint": ""})
    assert aware.modelled_step_time <= rescored.modelled_step_time
    padded = plan_dynamic(lengths, dp_size=2, max_tokens_per_gpu=8192, attention_weight=0.01)
    assert padded.modelled_step_time == pytest.approx(
        sum(padded.slot_costs()) + padded.overhead * padded.num_microbatches
    )
    # Weight 0 reproduces the token-only planner exactly (same plans, same fingerprints).
    assert plan_dynamic(lengths, dp_size=2, max_tokens_per_gpu=8192, attention_weight=0.0).fingerprint == (
        plan_dynamic(lengths, dp_size=2, max_tokens_per_gpu=8192).fingerprint
    )


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(layout="dense"), "layout must be one of padded, packed"),
        (dict(attention_weight=-1.0), "attention_weight"),
        (dict(attention_weight=math.nan), "attention_weight"),
    ],
)
def test_bad_layout_and_weight_name_the_argument(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        PlanArgs(dp_size=1, max_tokens_per_gpu=10, **kwargs)
