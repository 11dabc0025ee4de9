"""Load torch distributed checkpoints (DCP) without running code from the checkpoint.

Where torch 2.13's DCP load path unpickles what is on disk (``torch/distributed/checkpoint/``):

- ``FileSystemReader.read_metadata`` reads ``.metadata`` (or ``__<rank>.metadata``) with plain
  ``pickle.load``: a crafted file runs any code on resume. Here it goes through an unpickler that
  admits only the globals a real DCP ``.metadata`` holds (traced from a saved FSDP2 model + AdamW
  state: the ``metadata`` dataclasses, ``filesystem._StorageInfo``, ``torch.Size``, dtypes,
  ``torch.serialization._get_layout`` and the ``pathlib`` path of ``storage_meta.checkpoint_id``),
  and the result is checked for shape: storage entries must name plain files in the checkpoint
  directory (no ``../`` or absolute paths) at non-negative offsets.
- ``DefaultLoadPlanner.load_bytes`` loads every non-tensor entry (``BYTE_IO``: ints, floats,
  strings, lists such as AdamW's ``param_groups``) with ``torch.load(weights_only=False)``. Here
  they are loaded with ``weights_only=True``, whatever planner is passed.
- Tensors (``FileSystemReader.read_data``) already use ``torch.load(weights_only=True)``.
- Not on the load path: ``format_utils`` (``dcp_to_torch_save``, ``torch_save_to_dcp``) uses
  ``weights_only=False``; ``_pg_transport`` pickles between ranks; with a process group the
  coordinator broadcasts the metadata it read (here: safely) to the others as a pickle, which is
  peer-to-peer, not from disk.

Beyond code, a crafted checkpoint can hang or exhaust the process, or read files outside its
directory (``checkpoint_files``, ``bounded_pickle``). Here, too:

- ``.metadata`` is read by ``bounded_pickle`` (no shared containers, bounded depth and object
  count; at most ``MAX_METADATA_BYTES``), and every file of the checkpoint is opened only if it is
  a regular file and not a symlink (a FIFO would block ``open`` forever). Each declared
  ``offset + length`` must lie within its file, and no entry may declare stream transforms
  (compression), which we never write.
- Each tensor entry's ``torch.save`` archive must store its members uncompressed and its
  ``data.pkl`` passes the bounded scan before ``torch.load(weights_only=True)``, which runs with
  torch's own allowlist only (never globals other packages added). Non-tensor entries load as plain
  data (numbers, strings, lists, dicts, tuples) with no global at all.
- ``check_entries``: every entry this run loads exists, is of the kind (tensor or bytes) of the
  value it fills, and every ``_extra_state`` is empty (a tensor of no elements, or None): Transformer
  Engine's ``set_extra_state`` runs ``pickle.loads`` on a non-empty one.

``safe_load(state, path)`` is ``dcp.load`` with all of these guards.
"""

from __future__ import annotations

import io
import math
import os
from pathlib import Path, PurePath
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from backend.errors import CheckpointError

from .bounded_pickle import UnreadablePickleError, UnsafeCheckpointError, bounded_loads, is_flat_tuple
from .files import (
    MAX_PLAIN_ENTRY_BYTES,
    CheckpointFileError,
    load_plain_archive,
    only_torch_safe_globals,
    open_regular,
    read_regular,
    read_slice,
    scan_archive,
)

#: The largest ``.metadata`` read (31 KB for the quickstart, about 2 MB for a 4B model at DP 8).
MAX_METADATA_BYTES = 256 << 20

# (module, name) pairs a DCP .metadata may name. Everything else is refused.
_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",  # TensorProperties pickles its memory format as this enum
    )
}
_ALLOWED_GLOBALS = _METADATA_CLASSES | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # how torch.layout pickles: _get_layout("torch.strided")
    ("collections", "OrderedDict"),
    # StorageMeta.checkpoint_id is the directory as written; Python 3.13 moved the classes.
    *(
        (module, cls)
        for module in ("pathlib", "pathlib._local")
        for cls in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")
    ),
}


class CheckpointLayoutError(CheckpointError):
    """A readable checkpoint whose entries are not the ones this run loads (another model or
    parameter layout): resuming stops here rather than falling back to an older checkpoint."""


def _is_dtype(module: str, name: str) -> bool:
    return module == "torch" and name.isidentifier() and isinstance(getattr(torch, name, None), torch.dtype)


def _metadata_global(module: str, name: str) -> bool:
    return (module, name) in _ALLOWED_GLOBALS or _is_dtype(module, name)


def _metadata_key(key: Any) -> bool:
    """``storage_data``'s keys: a ``MetadataIndex`` of plain fields (checked before it is hashed)."""
    return (
        type(key) is dcp_metadata.MetadataIndex
        and isinstance(key.fqn, str)
        and (key.offset is None or is_flat_tuple(key.offset, 64))
        and (key.index is None or type(key.index) is int)
    )


def _plain_tensor_entry(entry: dcp_metadata.TensorStorageMetadata) -> bool:
    def ints(t) -> bool:
        return is_flat_tuple(t, 64) and len(t) == len(entry.size) and all(type(n) is int and n >= 0 for n in t)

    return (
        ints(entry.size)
        and type(entry.properties) is dcp_metadata.TensorProperties
        and isinstance(entry.properties.dtype, torch.dtype)
        and isinstance(entry.chunks, list)
        and all(
            type(c) is dcp_metadata.ChunkStorageMetadata and ints(c.offsets) and ints(c.sizes) for c in entry.chunks
        )
    )


def _describe(value: Any) -> str:
    """A loaded value for an error message, from its type and size (never its repr: a crafted
    object's repr can be arbitrarily large)."""
    if isinstance(value, str):
        return repr(value[:80]) + (f"... ({len(value):,} characters)" if len(value) > 80 else "")
    if isinstance(value, int | float | bool | type(None)):
        return (
            repr(value) if not isinstance(value, int) or abs(value) < 10**18 else f"an int of {value.bit_length()} bits"
        )
    size = f" of {len(value):,}" if isinstance(value, list | tuple | dict | str | bytes) else ""
    return f"a {type(value).__name__}{size}"


def read_metadata_file(path: str | os.PathLike) -> dcp_metadata.Metadata:
    """A DCP ``.metadata`` file through ``bounded_pickle`` with DCP's classes only, then checked
    for shape."""
    path = str(path)
    data = read_regular(path, MAX_METADATA_BYTES)
    try:
        md = bounded_loads(
            data,
            where=path,
            what="the checkpoint metadata",
            allow=_metadata_global,
            key_ok=_metadata_key,
            max_objects=max(1_000_000, len(data) // 8),
        )
    except UnreadablePickleError as e:
        reason = str(e).rsplit("(", 1)[-1].rstrip(")")
        raise CheckpointError(f"{path}: unreadable checkpoint metadata ({reason})") from None
    try:
        _check_metadata(md, path)
    except (AttributeError, TypeError) as e:  # an object built without the fields it should have
        raise UnsafeCheckpointError(
            f"{path}: refusing the checkpoint metadata: its objects lack their fields ({type(e).__name__})"
        ) from None
    return md


def _check_metadata(md: Any, path: str) -> None:
    def bad(what: str) -> CheckpointError:
        return UnsafeCheckpointError(f"{path}: refusing the checkpoint metadata: {what}")

    if type(md) is not dcp_metadata.Metadata:
        raise bad(f"it holds a {type(md).__name__}, not a torch.distributed.checkpoint Metadata")
    if not isinstance(md.state_dict_metadata, dict):
        raise bad("state_dict_metadata is not a dict")
    for key, value in md.state_dict_metadata.items():
        if not isinstance(key, str) or not isinstance(
            value, dcp_metadata.TensorStorageMetadata | dcp_metadata.BytesStorageMetadata
        ):
            raise bad(f"entry {_describe(key)} is not tensor or bytes storage metadata")
        if isinstance(value, dcp_metadata.TensorStorageMetadata) and not _plain_tensor_entry(value):
            raise bad(f"entry {_describe(key)} has a size, dtype or chunk list that is not plain numbers")
    if md.storage_meta is not None and type(md.storage_meta) is not dcp_metadata.StorageMeta:
        raise bad("storage_meta is not a StorageMeta")
    if not isinstance(md.storage_data, dict):
        raise bad("storage_data is not a dict (not written by FileSystemWriter)")
    for index, info in md.storage_data.items():
        if not isinstance(index, dcp_metadata.MetadataIndex) or type(info) is not _StorageInfo:
            raise bad(f"storage entry {_describe(index)} is not a MetadataIndex -> _StorageInfo pair")
        rel = info.relative_path
        # FileSystemWriter writes flat file names (__0_0.distcp) into the checkpoint directory.
        if not isinstance(rel, str) or rel in ("", ".", "..") or PurePath(rel).name != rel or "\\" in rel:
            raise bad(f"entry {_describe(index.fqn)} points outside the checkpoint directory ({_describe(rel)})")
        for field in ("offset", "length"):
            value = getattr(info, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise bad(f"entry {_describe(index.fqn)} has {field}={_describe(value)}")
        if getattr(info, "transform_descriptors", None):  # e.g. a decompressor: never written by us
            raise bad(f"entry {_describe(index.fqn)} declares stream transforms (compression), which we never write")


def _load_bytes_safely(value: io.BytesIO, where: str, fqn: str) -> Any:
    """A non-tensor entry as plain data (no global admitted); an ``_extra_state`` must be None."""
    data = value.getvalue()
    if len(data) > MAX_PLAIN_ENTRY_BYTES:
        raise UnsafeCheckpointError(
            f"{where}: a non-tensor entry of {len(data):,} bytes (at most {MAX_PLAIN_ENTRY_BYTES:,})"
        )
    try:
        obj = load_plain_archive(
            data, where, what="a non-tensor checkpoint entry that needs more than plain data to load"
        )
    except UnreadablePickleError as e:
        raise CheckpointError(str(e)) from None
    if fqn.endswith("_extra_state") and obj is not None:
        raise UnsafeCheckpointError(
            f"{where}: refusing a non-empty _extra_state ({_describe(obj)}): modules such as Transformer Engine's "
            f"unpickle it; this backend writes none"
        )
    return obj


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` whose non-tensor entries load with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        self.load_object(read_item, _load_bytes_safely(value, fqn, fqn))

    def load_object(self, read_item: ReadItem, obj: Any) -> None:
        # DefaultLoadPlanner.load_bytes, after its torch.load(value, weights_only=False).
        from torch.distributed.checkpoint._traverse import set_element

        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class _SafeBytesPlanner:
    """Wraps any planner during ``read_data``: bytes entries are unpickled here, weights-only."""

    def __init__(self, inner: LoadPlanner, reader: SafeFileSystemReader):
        self._inner = inner
        self._reader = reader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        info = self._reader.storage_data[read_item.storage_index]
        where = f"{Path(self._reader.path) / info.relative_path} ({read_item.dest_index.fqn})"
        obj = _load_bytes_safely(value, where, read_item.dest_index.fqn)
        if isinstance(self._inner, SafeLoadPlanner):
            self._inner.load_object(read_item, obj)
            return
        # Another planner unpickles what it is given, maybe with weights_only=False: hand it the
        # re-serialised plain data it was checked to be, never the bytes from disk.
        buf = io.BytesIO()
        torch.save(obj, buf)
        buf.seek(0)
        self._inner.load_bytes(read_item, buf)


#: What a ``torch.save`` archive adds to a tensor's bytes (zip headers, data.pkl, alignment).
_ARCHIVE_SLACK = 1 << 20


def _chunk_bytes(metadata: dcp_metadata.Metadata, index: dcp_metadata.MetadataIndex, where: str) -> int:
    """The bytes of the stored tensor chunk ``index`` names, from the metadata's size and dtype."""
    entry = metadata.state_dict_metadata.get(index.fqn)
    if not isinstance(entry, dcp_metadata.TensorStorageMetadata):
        raise UnsafeCheckpointError(f"{where}: a tensor read of an entry not stored as a tensor")
    itemsize = torch.empty((), dtype=entry.properties.dtype).element_size()
    for chunk in entry.chunks:
        if tuple(chunk.offsets) == tuple(index.offset or ()):
            return math.prod(chunk.sizes) * itemsize
    raise UnsafeCheckpointError(f"{where}: no stored chunk at this offset")


class _RegularFilesOnly(FileSystem):
    """DCP's local file system, opening for reading only regular files that are not symlinks."""

    def create_stream(self, path: str | os.PathLike, mode: str):
        if mode != "rb":
            raise ValueError(f"{path}: a checkpoint is only read here (mode {mode!r})")
        return open_regular(path)


class SafeFileSystemReader(FileSystemReader):
    """A ``FileSystemReader`` that runs no code from the checkpoint (see the module docstring)."""

    def __init__(self, path: str | os.PathLike, *args: Any, **kwargs: Any):
        super().__init__(path, *args, **kwargs)
        self.fs = _RegularFilesOnly()
        self._checked: dict[str, dcp_metadata.Metadata] = {}  # metadata path -> checked metadata

    def set_up_storage_reader(self, metadata: dcp_metadata.Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._metadata = metadata

    def _check_lengths(self, plan: LoadPlan) -> None:
        """No entry may make us read more than its value can need: a tensor chunk's bytes (from its
        declared size and dtype) plus the archive's own few KB, or ``MAX_PLAIN_ENTRY_BYTES``. A
        declared 4 GiB on a sparse file is refused before a byte is read."""
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            where = f"{Path(self.path) / info.relative_path} ({item.storage_index.fqn})"
            limit = MAX_PLAIN_ENTRY_BYTES
            if item.type != LoadItemType.BYTE_IO:
                limit = _ARCHIVE_SLACK + _chunk_bytes(self._metadata, item.storage_index, where)
            if info.length > limit:
                raise UnsafeCheckpointError(f"{where}: the entry declares {info.length:,} bytes, more than {limit:,}")

    def _slice_file(self, file, sinfo: _StorageInfo) -> io.BytesIO:
        """The entry's bytes, within its file, as a checked ``torch.save`` archive."""
        where = str(Path(self.path) / sinfo.relative_path)
        self._reading = f"{where} (bytes {sinfo.offset:,}..{sinfo.offset + sinfo.length:,})"
        data = read_slice(file, sinfo.offset, sinfo.length, where)
        scan_archive(data, where)
        return io.BytesIO(data)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        super().reset(checkpoint_id)
        self._checked = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        path = str(self._get_metadata_path(kwargs.get("rank")))
        if path not in self._checked:
            self._checked[path] = read_metadata_file(path)
        metadata = self._checked[path]
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner):
        self._check_lengths(plan)
        if any(item.type == LoadItemType.BYTE_IO for item in plan.items):
            planner = _SafeBytesPlanner(planner, self)
        self._reading = str(self.path)
        try:
            with only_torch_safe_globals():
                return super().read_data(plan, planner)
        except (CheckpointError, MemoryError, torch.OutOfMemoryError):
            raise  # ours already names the file; running out of memory is no verdict on the checkpoint
        except Exception as e:  # torch's own refusal (a damaged archive, a bad tensor record): name the file
            reason = (str(e).strip().splitlines() or [""])[0][:300]
            raise CheckpointFileError(f"{self._reading}: unreadable: {type(e).__name__}: {reason}") from e


def _user_error_inside(exc: CheckpointException) -> CheckpointError | None:
    """DCP wraps every rank's exception into one CheckpointException (a BaseException); ours inside
    is the message worth showing."""
    for failure in exc.failures.values():
        inner = failure[0] if isinstance(failure, tuple) and failure else failure
        if isinstance(inner, CheckpointError):
            return inner
    return None


def check_entries(state: dict, metadata: dcp_metadata.Metadata, path) -> None:
    """Every entry ``state`` asks for is in the checkpoint, or a ``CheckpointError`` naming the path,
    how many are missing and which names the checkpoint holds instead (DCP's own strict check
    names one key, per rank, inside a multi-rank report). The names are DCP's flattened ones."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    wanted, _ = flatten_state_dict(state)
    missing = sorted(k for k in wanted if k not in metadata.state_dict_metadata)
    if not missing:
        _check_kinds(wanted, metadata, path)
        return
    extra = sorted(k for k in metadata.state_dict_metadata if k not in wanted)
    raise CheckpointLayoutError(
        f"{path}: the checkpoint lacks {len(missing)} of the {len(wanted)} entries this run loads "
        f"(e.g. {', '.join(missing[:3])})"
        + (f"; it holds {len(extra)} this run does not (e.g. {', '.join(extra[:3])})" if extra else "")
        + ": it was saved for another model or parameter layout than the configured one"
    )


def _check_kinds(wanted: dict, metadata: dcp_metadata.Metadata, path) -> None:
    """Each entry fills a value of its own kind (a tensor from tensor storage, anything else from
    bytes) and, for a tensor, of its own shape (a checkpoint of a 128-wide model loaded into a
    64-wide one is refused here, naming the first parameter that differs, instead of DCP's
    multi-rank size-mismatch traceback); an ``_extra_state`` stored as a tensor holds no elements."""
    for key, value in wanted.items():
        stored = metadata.state_dict_metadata[key]
        is_tensor = isinstance(stored, dcp_metadata.TensorStorageMetadata)
        if is_tensor != isinstance(value, torch.Tensor):
            raise UnsafeCheckpointError(
                f"{path}: refusing entry {key}: stored as {'a tensor' if is_tensor else 'bytes'}, but this run "
                f"loads {'a tensor' if isinstance(value, torch.Tensor) else 'a non-tensor value'} there"
            )
        if is_tensor and tuple(stored.size) != tuple(value.shape) and not key.endswith("_extra_state"):
            raise CheckpointLayoutError(
                f"{path}: {key} has shape {list(stored.size)} in the checkpoint but {list(value.shape)} in the "
                f"configured model: it was saved for another model (check model.* and the checkpoint path)"
            )
        if is_tensor and key.endswith("_extra_state") and math.prod(stored.size) > 0:
            raise UnsafeCheckpointError(
                f"{path}: refusing a non-empty _extra_state tensor ({key}, size {list(stored.size)}): modules such "
                f"as Transformer Engine's unpickle it; this backend writes none"
            )


def safe_load(state: dict, path: str | os.PathLike, *, planner: LoadPlanner | None = None, process_group=None) -> None:
    """``dcp.load(state, checkpoint_id=path)`` that never unpickles more than plain data; in place.

    The metadata is read (and checked) once before DCP starts, so a refused or damaged file raises
    its own ``CheckpointError`` naming the file on every rank that reads it, instead of DCP's
    fallback to rank-local metadata and its multi-rank ``CheckpointException`` report.
    """
    reader = SafeFileSystemReader(path)
    if Path(reader._get_metadata_path()).is_file() or not any(Path(path).glob("__*.metadata")):
        metadata = reader.read_metadata()  # raises CheckpointError naming the file; cached for dcp.load
        if planner is None or (
            not getattr(planner, "allow_partial_load", False) and getattr(planner, "flatten_state_dict", True)
        ):
            check_entries(state, metadata, path)
    try:
        dcp.load(
            state,
            checkpoint_id=str(path),
            storage_reader=reader,
            planner=planner if planner is not None else SafeLoadPlanner(),
            process_group=process_group,
        )
    except CheckpointException as e:
        inner = _user_error_inside(e)
        if inner is None:
            raise
        raise inner from e
