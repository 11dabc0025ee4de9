"""The validation split is disjoint from training, fixed by the seed, and never reaches a window."""

from __future__ import annotations

import numpy as np
import pytest

from backend.data.errors import DataError
from backend.data.jsonl import InMemoryDataset
from backend.data.sample import Sample
from backend.data.sampler import WindowSampler
from backend.data.split import evaluation_ids, split_off_validation


def dataset(n: int) -> InMemoryDataset:
    return InMemoryDataset([Sample(tokens=np.arange(i % 9 + 2)) for i in range(n)], source="d.jsonl")


def test_validation_samples_never_appear_in_training_windows():
    base = dataset(200)
    train, valid = split_off_validation(base, 0.1, seed=3)
    assert len(valid) == 20 and len(train) == 180
    valid_ids = set(valid.ids.tolist())
    assert not valid_ids & set(train.ids.tolist())
    sampler = WindowSampler(len(train), 64, seed=3)
    for _ in range(10):  # several epochs of windows
        window = sampler.next_window()
        assert not {int(train.ids[i]) for i in window} & valid_ids
    again, _ = split_off_validation(base, 0.1, seed=3)
    assert np.array_equal(again.ids, train.ids)
    other, _ = split_off_validation(base, 0.1, seed=4)
    assert not np.array_equal(other.ids, train.ids)
    assert np.array_equal(train.lengths, base.lengths[train.ids])


def test_split_errors_and_eval_subset():
    with pytest.raises(DataError, match="data.valid_fraction"):
        split_off_validation(dataset(3), 0.99, seed=0)
    _, valid = split_off_validation(dataset(100), 0.2, seed=0)
    assert evaluation_ids(valid, 0).tolist() == list(range(20))
    assert evaluation_ids(valid, 5).tolist() == list(range(5))
