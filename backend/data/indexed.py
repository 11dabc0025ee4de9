"""Megatron ``.bin/.idx`` datasets, read and written with megatron-core's ``indexed_dataset``.

Tokens live at PREFIX.bin/.idx. Optional per-token arrays live beside them, one document per
sample, so the index of each still gives every length without reading data:
PREFIX_loss_mask (uint8), PREFIX_loss_weight (float32), and the policy-gradient fields
PREFIX_advantages, PREFIX_old_logprobs, PREFIX_ref_logprobs (float32; NaN where a sample had none,
which is refused when read at a loss token).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from .errors import DataFileError, DataNotFoundError
from .row_fields import PASS_THROUGH, RowFields, check_finite_where_used, refusal
from .sample import POLICY_FIELDS, Sample

MASK_SUFFIX = "_loss_mask"
WEIGHT_SUFFIX = "_loss_weight"
# Every per-token sidecar: field -> (file suffix, dtype, the value a sample without it gets).
SIDECARS = {
    "loss_mask": (MASK_SUFFIX, np.uint8, 1),
    "loss_weight": (WEIGHT_SUFFIX, np.float32, 1.0),
    **{name: (f"_{name}", np.float32, np.nan) for name in POLICY_FIELDS},
}

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


def write_indexed(
    prefix: str | Path, samples: Iterable[Sample], vocab_size: int, *, empty_ok: bool = True, source: str = ""
) -> int:
    """Write samples as PREFIX.bin/.idx (and a sidecar per field any sample has), streaming: one
    sample in memory at a time, so a data set larger than memory converts.

    A sidecar is started at the first sample holding its field, with every earlier sample's fill
    value written first (only their lengths are kept). Files are written under temporary names
    and renamed into place only when complete, so a reader (or a concurrent writer on another
    rank) never sees half a dataset. Returns the count.
    """
    import torch

    ids = _indexed_dataset()
    prefix = str(prefix)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{prefix}.tmp{os.getpid()}"

    def builder(suffix: str, dtype):
        return ids.IndexedDatasetBuilder(f"{tmp}{suffix}.bin", dtype=dtype)

    def add(b, values, dtype) -> None:
        b.add_item(torch.from_numpy(np.ascontiguousarray(values, dtype=dtype)))
        b.end_document()

    tokens_dtype = token_dtype(vocab_size)
    outputs = {"": (builder("", tokens_dtype), tokens_dtype)}
    lengths: list[int] = []
    try:
        _write(samples, outputs, lengths, builder, add, tokens_dtype)
        if not lengths and not empty_ok:
            raise DataFileError(f"{source or prefix}: no samples (the file is empty or blank)")
        for suffix, (b, _) in outputs.items():
            b.finalize(f"{tmp}{suffix}.idx")
    except BaseException:  # a bad row stops the conversion: nothing is left behind
        for suffix in outputs:
            for ext in (".bin", ".idx"):
                Path(f"{tmp}{suffix}{ext}").unlink(missing_ok=True)
        raise
    for suffix in outputs:
        for ext in (".bin", ".idx"):
            os.replace(f"{tmp}{suffix}{ext}", f"{prefix}{suffix}{ext}")
    return len(lengths)


def _write(samples, outputs: dict, lengths: list[int], builder, add, tokens_dtype) -> None:
    for s in samples:
        for name, (suffix, dtype, fill) in SIDECARS.items():
            value = getattr(s, name)
            if value is not None and suffix not in outputs:
                outputs[suffix] = (builder(suffix, dtype), dtype)
                for n in lengths:  # earlier samples had no such field
                    add(outputs[suffix][0], np.full(n, fill, dtype), dtype)
            if suffix in outputs:
                add(outputs[suffix][0], value if value is not None else np.full(len(s.tokens), fill, dtype), dtype)
        add(outputs[""][0], s.tokens, tokens_dtype)
        lengths.append(len(s.tokens))


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
    """Samples from PREFIX.bin/.idx, memory-mapped; lengths come from the index alone.

    ``fields`` says which policy-field sidecars are read, required or refused (default: read
    whatever is there). Their values are checked when a sample is read: non-finite at a loss
    token stops the run naming the file, the sample and the field.
    """

    def __init__(self, prefix: str | Path, fields: RowFields = PASS_THROUGH):
        ids = _indexed_dataset()
        self.prefix = str(prefix)
        self.source = f"{self.prefix}.bin/.idx"
        if not indexed_exists(self.prefix):
            raise DataNotFoundError(f"data.path: no {self.prefix}.bin and {self.prefix}.idx")
        present = [name for name, (suffix, _, _) in SIDECARS.items() if indexed_exists(self.prefix + suffix)]
        for name in fields.refuse:
            if name in present:
                raise DataFileError(f"{self.prefix}_{name}.bin/.idx: {refusal(name, fields)}")
        for name in fields.required:
            if name not in present:
                raise DataFileError(
                    f"{self.source}: no {self.prefix}_{name}.bin/.idx, but {fields.why} needs '{name}' per token "
                    f"(write it with tools/preprocess_data.py from rows that carry it)"
                )
        wanted = [name for name in present if name in ("loss_mask", "loss_weight") or name in fields.read]
        check_indexed_files(self.prefix)
        for name in wanted:
            check_indexed_files(self.prefix + SIDECARS[name][0])
        self._tokens = ids.IndexedDataset(self.prefix)
        self.lengths = np.asarray(self._tokens.sequence_lengths, dtype=np.int64)
        self._extra = {name: ids.IndexedDataset(self.prefix + SIDECARS[name][0]) for name in wanted}
        for name, extra in self._extra.items():
            if not np.array_equal(np.asarray(extra.sequence_lengths), self.lengths):
                raise DataFileError(
                    f"{self.source}: the {name} files do not match the token lengths sample for sample; {_REBUILD}"
                )
        self.ignored_fields = {name: len(self.lengths) for name in present if name not in wanted}
        self._mask = self._extra.get("loss_mask")
        self.has_loss_weight = "loss_weight" in self._extra
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
        arrays = {name: np.asarray(extra.get(index)) for name, extra in self._extra.items()}
        mask = arrays.get("loss_mask")
        for name in POLICY_FIELDS:
            if name in arrays:
                arrays[name] = arrays[name].astype(np.float32)
                check_finite_where_used(name, arrays[name], mask, f"{self.prefix}_{name}.bin sample {index}")
        if "loss_weight" in arrays:
            arrays["loss_weight"] = arrays["loss_weight"].astype(np.float32)
        return Sample(tokens=np.asarray(self._tokens.get(index), dtype=np.int64), **arrays)
