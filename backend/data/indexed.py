"""Megatron ``.bin/.idx`` datasets, read and written with megatron-core's ``indexed_dataset``.

Tokens live at PREFIX.bin/.idx. Optional per-token loss masks and loss weights live beside
them at PREFIX_loss_mask.bin/.idx (uint8) and PREFIX_loss_weight.bin/.idx (float32), one
document per sample, so the index of each still gives every length without reading data.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from .errors import DataFileError, DataNotFoundError
from .sample import Sample

MASK_SUFFIX = "_loss_mask"
WEIGHT_SUFFIX = "_loss_weight"

# megatron-core's .idx layout (indexed_dataset._IndexWriter): magic, version <Q, dtype code <B,
# sequence count <Q, document count <Q (34 bytes), then sequence lengths int32[n], byte pointers
# into the .bin int64[n], document indices int64[d] (and int8[n] sequence modes when multimodal).
_IDX_MAGIC = b"MMIDIDX\x00\x00"
_IDX_HEADER = struct.Struct("<9sQBQQ")
_DTYPE_SIZES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}  # megatron's DType codes -> item size
_REBUILD = "rebuild it with tools/preprocess_data.py or point data.path at another prefix"


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


def check_indexed_files(prefix: str | Path) -> int:
    """Check PREFIX.idx against its own header and PREFIX.bin against the index; return the count.

    megatron-core's reader trusts both files: a truncated .idx fails deep inside it with a bare
    ``struct.error`` or assertion, and a short .bin only when a sample past its end is read,
    mid-training. This reads the 34-byte header itself, requires the index to be exactly as long
    as the header says, and every sequence to end inside the .bin, so a damaged pair is refused at
    open with the file named. Costs one pass over the lengths and pointers (12 bytes a sample).
    """
    idx, bin_ = f"{prefix}.idx", f"{prefix}.bin"
    idx_size, bin_size = os.path.getsize(idx), os.path.getsize(bin_)
    with open(idx, "rb") as f:
        head = f.read(_IDX_HEADER.size)
    if len(head) < _IDX_HEADER.size:
        raise DataFileError(f"{idx}: truncated index ({idx_size} bytes, shorter than its 34-byte header); {_REBUILD}")
    magic, version, code, count, doc_count = _IDX_HEADER.unpack(head)
    if magic != _IDX_MAGIC:
        raise DataFileError(f"{idx}: not a megatron-core index (bad magic bytes {magic!r}); {_REBUILD}")
    if version != 1:
        raise DataFileError(f"{idx}: index version {version}, only version 1 is known; {_REBUILD}")
    if code not in _DTYPE_SIZES:
        raise DataFileError(f"{idx}: unknown token dtype code {code}; {_REBUILD}")
    expected = _IDX_HEADER.size + 12 * count + 8 * doc_count
    if idx_size not in (expected, expected + count):  # + count: the multimodal variant's modes
        raise DataFileError(
            f"{idx}: {idx_size} bytes, but its header promises {count} sequences and {doc_count} document "
            f"indices ({expected} bytes): the index is truncated or corrupt; {_REBUILD}"
        )
    if count == 0:
        raise DataFileError(f"{prefix}.bin/.idx: no samples; point data.path at a data set that has some")
    lengths = np.memmap(idx, dtype=np.int32, mode="r", offset=_IDX_HEADER.size, shape=(count,))
    pointers = np.memmap(idx, dtype=np.int64, mode="r", offset=_IDX_HEADER.size + 4 * count, shape=(count,))
    if int(lengths.min()) < 0 or int(pointers.min()) < 0:
        raise DataFileError(f"{idx}: negative sequence lengths or pointers: the index is corrupt; {_REBUILD}")
    ends = pointers + lengths.astype(np.int64) * _DTYPE_SIZES[code]
    last = int(np.argmax(ends))
    if int(ends[last]) > bin_size:
        raise DataFileError(
            f"{bin_}: {bin_size} bytes, but {idx} puts sample {last} at bytes {int(pointers[last])}.."
            f"{int(ends[last])}: the .bin is truncated or belongs to another index; {_REBUILD}"
        )
    return count


class IndexedTokenDataset:
    """Samples from PREFIX.bin/.idx, memory-mapped; lengths come from the index alone."""

    def __init__(self, prefix: str | Path):
        ids = _indexed_dataset()
        self.prefix = str(prefix)
        self.source = f"{self.prefix}.bin/.idx"
        if not indexed_exists(self.prefix):
            raise DataNotFoundError(f"data.path: no {self.prefix}.bin and {self.prefix}.idx")
        for suffix in ("", MASK_SUFFIX, WEIGHT_SUFFIX):
            if suffix == "" or indexed_exists(self.prefix + suffix):
                check_indexed_files(self.prefix + suffix)
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
                raise DataFileError(
                    f"{self.source}: the {name} files do not match the token lengths sample for sample; {_REBUILD}"
                )
        self.has_loss_weight = self._weight is not None
        if self._mask is None:
            self.loss_token_counts = np.maximum(self.lengths - 1, 0)
        else:
            self.loss_token_counts = np.array(
                [int(np.count_nonzero(self._mask.get(i)[1:])) for i in range(len(self.lengths))], dtype=np.int64
            )

    @property
    def token_itemsize(self) -> int:
        """Bytes per token id in PREFIX.bin (1: uint8, 2: uint16, 4: int32): the largest
        vocabulary the writer expected (``token_dtype``)."""
        with open(f"{self.prefix}.idx", "rb") as f:
            return _DTYPE_SIZES[_IDX_HEADER.unpack(f.read(_IDX_HEADER.size))[2]]

    def last_token(self, index: int) -> int:
        """The last token id of sample ``index`` (reads one token)."""
        index = int(index)
        return int(self._tokens.get(index, offset=int(self.lengths[index]) - 1, length=1)[0])

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> Sample:
        index = int(index)
        return Sample(
            tokens=np.asarray(self._tokens.get(index), dtype=np.int64),
            loss_mask=None if self._mask is None else np.asarray(self._mask.get(index)),
            loss_weight=None if self._weight is None else np.asarray(self._weight.get(index), dtype=np.float32),
        )
