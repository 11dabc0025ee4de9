"""Validation data: a separate file (``data.valid_path``) or a seeded, disjoint split of the
training data (``data.valid_fraction``), and the fixed subset evaluated every time.

The split is a function of (number of samples, fraction, seed) only, so every rank and every
restart draws the same validation samples, and the training sampler only ever sees the rest: a
validation sample can never appear in a training window.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .errors import DataError


class SubsetDataset:
    """The samples ``ids`` of ``base``, renumbered 0..len(ids)-1 (lengths known without reading)."""

    def __init__(self, base, ids: np.ndarray, *, source: str):
        self.base = base
        self.ids = np.asarray(ids, dtype=np.int64)
        self.source = source
        self.lengths = np.asarray(base.lengths)[self.ids]
        self.loss_token_counts = np.asarray(base.loss_token_counts)[self.ids]
        self.has_loss_weight = getattr(base, "has_loss_weight", False)
        self.ignored_fields = getattr(base, "ignored_fields", {})
        self.note = getattr(base, "note", "")  # how the source was prepared (documents cut), for the summary
        self.report = getattr(base, "report", None)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int):
        return self.base[int(self.ids[int(index)])]


def split_off_validation(dataset, fraction: float, seed: int) -> tuple[SubsetDataset, SubsetDataset]:
    """(train, valid): ``round(fraction * n)`` samples (at least 1) drawn with ``seed``, disjoint."""
    n = len(dataset)
    count = max(1, round(fraction * n))
    if count >= n:
        raise DataError(
            f"{dataset.source}: data.valid_fraction={fraction} leaves no training samples out of {n}; lower it"
        )
    order = np.random.default_rng([seed, 0x7A11D]).permutation(n)
    valid_ids, train_ids = np.sort(order[:count]), np.sort(order[count:])
    return (
        SubsetDataset(dataset, train_ids, source=dataset.source),
        SubsetDataset(dataset, valid_ids, source=f"{dataset.source} (validation split, {count} samples)"),
    )


def build_train_and_valid(data_cfg, seed: int, *, build):
    """(train, valid or None, tokenizer) with ``build(data_cfg) -> (dataset, tokenizer)`` (the
    caller binds the row fields its loss reads, ``functools.partial(build_dataset, fields=...)``)."""
    train, tokenizer = build(data_cfg)
    if data_cfg.valid_path:
        valid, _ = build(dataclasses.replace(data_cfg, path=data_cfg.valid_path))
        return train, valid, tokenizer
    if data_cfg.valid_fraction > 0:
        train, valid = split_off_validation(train, data_cfg.valid_fraction, seed)
        return train, valid, tokenizer
    return train, None, tokenizer


def evaluation_ids(valid, eval_samples: int) -> np.ndarray:
    """The fixed samples evaluated every time: the first ``eval_samples`` (0 = all) in index order."""
    n = len(valid) if not eval_samples else min(eval_samples, len(valid))
    return np.arange(n)
