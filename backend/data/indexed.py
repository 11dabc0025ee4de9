"""Megatron ``.bin/.idx`` datasets, read and written with megatron-core's ``indexed_dataset``.

Tokens live at PREFIX.bin/.idx. Optional per-token loss masks and loss weights live beside
them at PREFIX_loss_mask.bin/.idx (uint8) and PREFIX_loss_weight.bin/.idx (float32), one
document per sample, so the index of each still gives every length without reading data.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from .sample import Sample

MASK_SUFFIX = "_loss_mask"
WEIGHT_SUFFIX = "_loss_weight"


def _indexed_dataset():
    # megatron-core's package import is slow (about 9 s); only pay it when .bin/.idx is used.
    from backend.megatron_compat import import_megatron_module

    return import_megatron_module("megatron.core.datasets.indexed_dataset")


def token_dtype(vocab_size: int) -> type:
    return np.uint8 if vocab_size <= 256 else np.uint16 if vocab_size <= 65536 else np.int32


def write_indexed(prefix: str | Path, samples: Iterable[Sample], vocab_size: int) -> int:
    """Write samples as PREFIX.bin/.idx (and mask/weight siblings when any sample has them).

    Files are written under temporary names and renamed into place only when complete, so a
    reader (or a concurrent writer on another rank) never sees half a dataset. Returns the count.
    """
    import torch

    ids = _indexed_dataset()
    prefix = str(prefix)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{prefix}.tmp{os.getpid()}"
    samples = list(samples)
    has_mask = any(s.loss_mask is not None for s in samples)
    has_weight = any(s.loss_weight is not None for s in samples)
    outputs = [("", token_dtype(vocab_size), lambda s: s.tokens)]
    if has_mask:
        outputs.append(
            (
                MASK_SUFFIX,
                np.uint8,
                lambda s: s.loss_mask if s.loss_mask is not None else np.ones(len(s.tokens), np.uint8),
            )
        )
    if has_weight:
        outputs.append(
            (
                WEIGHT_SUFFIX,
                np.float32,
                lambda s: s.loss_weight if s.loss_weight is not None else np.ones(len(s.tokens), np.float32),
            )
        )
    for suffix, dtype, field in outputs:
        builder = ids.IndexedDatasetBuilder(f"{tmp}{suffix}.bin", dtype=dtype)
        for s in samples:
            builder.add_item(torch.from_numpy(np.ascontiguousarray(field(s), dtype=dtype)))
            builder.end_document()
        builder.finalize(f"{tmp}{suffix}.idx")
    for suffix, _, _ in outputs:
        for ext in (".bin", ".idx"):
            os.replace(f"{tmp}{suffix}{ext}", f"{prefix}{suffix}{ext}")
    return len(samples)


def indexed_exists(prefix: str | Path) -> bool:
    return Path(f"{prefix}.bin").is_file() and Path(f"{prefix}.idx").is_file()


class IndexedTokenDataset:
    """Samples from PREFIX.bin/.idx, memory-mapped; lengths come from the index alone."""

    def __init__(self, prefix: str | Path):
        ids = _indexed_dataset()
        self.prefix = str(prefix)
        self.source = f"{self.prefix}.bin/.idx"
        if not indexed_exists(self.prefix):
            raise FileNotFoundError(f"data.path: no {self.prefix}.bin and {self.prefix}.idx")
        self._tokens = ids.IndexedDataset(self.prefix)
        self.lengths = np.asarray(self._tokens.sequence_lengths, dtype=np.int64)
        self._mask = (
            ids.IndexedDataset(self.prefix + MASK_SUFFIX) if indexed_exists(self.prefix + MASK_SUFFIX) else None
        )
        self._weight = (
            ids.IndexedDataset(self.prefix + WEIGHT_SUFFIX) if indexed_exists(self.prefix + WEIGHT_SUFFIX) else None
        )
        for name, extra in (("loss mask", self._mask), ("loss weight", self._weight)):
            if extra is not None and not np.array_equal(np.asarray(extra.sequence_lengths), self.lengths):
                raise ValueError(f"{self.source}: the {name} files do not match the token lengths sample for sample")
        self.has_loss_weight = self._weight is not None
        if self._mask is None:
            self.loss_token_counts = np.maximum(self.lengths - 1, 0)
        else:
            self.loss_token_counts = np.array(
                [int(np.count_nonzero(self._mask.get(i)[1:])) for i in range(len(self.lengths))], dtype=np.int64
            )

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> Sample:
        index = int(index)
        return Sample(
            tokens=np.asarray(self._tokens.get(index), dtype=np.int64),
            loss_mask=None if self._mask is None else np.asarray(self._mask.get(index)),
            loss_weight=None if self._weight is None else np.asarray(self._weight.get(index), dtype=np.float32),
        )
