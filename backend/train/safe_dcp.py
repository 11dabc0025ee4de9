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

``safe_load(state, path)`` is ``dcp.load`` with both guards.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path, PurePath
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from backend.errors import CheckpointError

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


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file that would need more than DCP's own classes to load."""


class CheckpointLayoutError(CheckpointError):
    """A readable checkpoint whose entries are not the ones this run loads (another model or
    parameter layout): resuming stops here rather than falling back to an older checkpoint."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: str):
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS or _is_dtype(module, name):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"{self._path}: refusing to load the checkpoint: its metadata names the global {module}.{name}, which "
            f"torch.distributed.checkpoint never writes (a tampered or foreign file; it could run code). Load "
            f"checkpoints only from sources you trust, or point checkpoint.dir elsewhere"
        )

    def persistent_load(self, pid):
        raise UnsafeCheckpointError(f"{self._path}: refusing a persistent id in checkpoint metadata")


def _is_dtype(module: str, name: str) -> bool:
    return module == "torch" and name.isidentifier() and isinstance(getattr(torch, name, None), torch.dtype)


def read_metadata_file(path: str | os.PathLike) -> dcp_metadata.Metadata:
    """Unpickle a DCP ``.metadata`` file with DCP's classes only, then check its shape."""
    path = str(path)
    try:
        with open(path, "rb") as f:
            md = _MetadataUnpickler(f, path).load()
    except UnsafeCheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file: not a complete distributed checkpoint (checkpoint.dir)") from None
    except Exception as e:  # truncated or corrupt pickle: UnpicklingError, EOFError, ValueError, TypeError...
        raise CheckpointError(f"{path}: unreadable checkpoint metadata ({type(e).__name__}: {e})") from None
    _check_metadata(md, path)
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
            raise bad(f"entry {key!r} is not tensor or bytes storage metadata")
    if not isinstance(md.storage_data, dict):
        raise bad("storage_data is not a dict (not written by FileSystemWriter)")
    for index, info in md.storage_data.items():
        if not isinstance(index, dcp_metadata.MetadataIndex) or type(info) is not _StorageInfo:
            raise bad(f"storage entry {index!r} is not a MetadataIndex -> _StorageInfo pair")
        rel = info.relative_path
        # FileSystemWriter writes flat file names (__0_0.distcp) into the checkpoint directory.
        if not isinstance(rel, str) or rel in ("", ".", "..") or PurePath(rel).name != rel or "\\" in rel:
            raise bad(f"entry {index.fqn!r} points outside the checkpoint directory ({rel!r})")
        for field in ("offset", "length"):
            value = getattr(info, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise bad(f"entry {index.fqn!r} has {field}={value!r}")
        descriptors = getattr(info, "transform_descriptors", None)
        if descriptors is not None and not all(isinstance(d, str) for d in descriptors):
            raise bad(f"entry {index.fqn!r} has non-string transform descriptors")


def _load_bytes_safely(value: io.BytesIO, where: str) -> Any:
    try:
        return torch.load(value, map_location="cpu", weights_only=True)
    except Exception as e:
        # torch's message opens with advice to retry with weights_only=False; keep the line that
        # says what was refused ("Trying to load unsupported GLOBAL posix.system ...").
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        first = next((line for line in lines if "GLOBAL" in line), lines[0] if lines else type(e).__name__)
        raise UnsafeCheckpointError(
            f"{where}: refusing a non-tensor checkpoint entry that needs more than plain data to load ({first})"
        ) from None


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` whose non-tensor entries load with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.load_object(read_item, _load_bytes_safely(value, read_item.dest_index.fqn))

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
        obj = _load_bytes_safely(value, where)
        if isinstance(self._inner, SafeLoadPlanner):
            self._inner.load_object(read_item, obj)
            return
        # Another planner unpickles what it is given, maybe with weights_only=False: hand it the
        # re-serialised plain data it was checked to be, never the bytes from disk.
        buf = io.BytesIO()
        torch.save(obj, buf)
        buf.seek(0)
        self._inner.load_bytes(read_item, buf)


class SafeFileSystemReader(FileSystemReader):
    """A ``FileSystemReader`` that runs no code from the checkpoint (see the module docstring)."""

    def __init__(self, path: str | os.PathLike, *args: Any, **kwargs: Any):
        super().__init__(path, *args, **kwargs)
        self._checked: dict[str, dcp_metadata.Metadata] = {}  # metadata path -> checked metadata

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
        if any(item.type == LoadItemType.BYTE_IO for item in plan.items):
            planner = _SafeBytesPlanner(planner, self)
        return super().read_data(plan, planner)


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
        return
    extra = sorted(k for k in metadata.state_dict_metadata if k not in wanted)
    raise CheckpointLayoutError(
        f"{path}: the checkpoint lacks {len(missing)} of the {len(wanted)} entries this run loads "
        f"(e.g. {', '.join(missing[:3])})"
        + (f"; it holds {len(extra)} this run does not (e.g. {', '.join(extra[:3])})" if extra else "")
        + ": it was saved for another model or parameter layout than the configured one"
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
