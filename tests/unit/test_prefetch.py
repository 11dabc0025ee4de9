"""The background window preparation hands out exactly what the synchronous iterator does, in the
same order, resumes exactly from a state taken mid-run, and raises a preparation error at the
step that needs that window."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from backend.batching import PlanArgs, make_planner
from backend.data.errors import DataFormatError
from backend.data.iterator import DataIterator
from backend.data.jsonl import InMemoryDataset
from backend.data.prefetch import PrefetchingIterator, SyncIterator
from backend.data.sample import Sample
from backend.data.sampler import WindowSampler

WINDOW, STEPS = 16, 12


def _dataset(n=40, seed=0):
    rng = np.random.default_rng(seed)
    return InMemoryDataset([Sample(tokens=rng.integers(0, 256, int(rng.integers(5, 300)))) for _ in range(n)], "x")


def _iterator(dataset, *, prefetch: bool, layout="packed"):
    args = PlanArgs(dp_size=2, cp_size=2, max_tokens_per_gpu=512, layout=layout)
    windows = DataIterator(
        dataset,
        WindowSampler(len(dataset), WINDOW, seed=7),
        make_planner("dynamic", args),
        dp_rank=1,
        cp_rank=1,
        cp_size=2,
    )
    return PrefetchingIterator(windows) if prefetch else SyncIterator(windows)


def _same(a, b) -> None:
    assert np.array_equal(a.window_ids, b.window_ids) and a.plan.fingerprint == b.plan.fingerprint
    assert a.global_loss_tokens == b.global_loss_tokens and len(a.microbatches) == len(b.microbatches)
    for x, y in zip(a.microbatches, b.microbatches):
        for name, value in vars(x).items():
            other = getattr(y, name)
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, name


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_prefetched_run_with_a_resume_equals_the_synchronous_run(layout):
    dataset = _dataset()
    sync = _iterator(dataset, prefetch=False, layout=layout)
    expected = [next(sync) for _ in range(STEPS)]
    first = _iterator(dataset, prefetch=True, layout=layout)
    got = [next(first) for _ in range(STEPS // 2)]
    state = first.state_dict()  # window STEPS // 2 + 1 is already being prepared: not counted
    assert state["sampler"]["consumed"] == WINDOW * (STEPS // 2)
    resumed = _iterator(dataset, prefetch=True, layout=layout)
    resumed.load_state_dict(state)
    got += [next(resumed) for _ in range(STEPS - STEPS // 2)]
    for a, b in zip(expected, got):
        _same(a, b)


def test_state_counts_only_windows_handed_out():
    it = _iterator(_dataset(), prefetch=True)
    assert it.state_dict()["sampler"]["consumed"] == 0
    next(it)
    it.pending[0].join()  # the next window is ready in the background ...
    assert it.state_dict()["sampler"]["consumed"] == WINDOW  # ... but not handed out


class _Failing(InMemoryDataset):
    """Sample ``bad`` raises the way a malformed row does."""

    def __init__(self, base, bad):
        super().__init__(base.samples, base.source)
        self.bad = bad

    def __getitem__(self, index):
        if int(index) == self.bad:
            raise DataFormatError(f"rows.jsonl:{self.bad + 1}: 'advantages' is nan at token 3")
        return super().__getitem__(index)


def test_a_background_error_surfaces_at_the_step_that_needs_it():
    base = _dataset()
    sync = _iterator(base, prefetch=False)
    third = [next(sync) for _ in range(3)][-1]
    bad = int(next(mb for mb in third.microbatches if not mb.is_empty).sample_ids[0])  # this rank reads it
    it = _iterator(_Failing(base, bad), prefetch=True)
    next(it), next(it)  # the first two windows come through although the third is failing behind them
    with pytest.raises(DataFormatError, match=rf"rows.jsonl:{bad + 1}: 'advantages' is nan"):
        next(it)
