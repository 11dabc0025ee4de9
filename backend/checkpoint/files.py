"""Opening and reading the files of a checkpoint directory as untrusted input.

A checkpoint may come from anyone (a shared directory, a download, a copied run), so every file in
it is read as if crafted:

- opened with ``O_NOFOLLOW | O_NONBLOCK`` and used only if ``fstat`` says it is a regular file:
  a symlink (to another run's weights, to ``/etc/passwd``, to ``/dev/zero``) or a FIFO (whose
  ``open`` would block forever) is refused, naming the path; a step directory that is a symlink is
  refused too (``check_step_dir``). The checkpoint root itself may be a link (a run directory on
  another disk).
- read up to a cap measured against the file's own size: a length the metadata declares beyond
  the end of its file is refused before a byte is read.
- ``torch.save`` archives (zip files holding ``data.pkl`` and the storages) must store their
  members uncompressed with sizes that add up: a 2 MB deflated member inflating to 2 GiB is
  refused. Their ``data.pkl`` goes through ``bounded_pickle`` (no shared containers, bounded
  depth and object count) before any loader sees it.
- ``torch.load(weights_only=True)`` runs with only torch's own allowlist
  (``only_torch_safe_globals``): globals other packages added with ``add_safe_globals`` (an
  object-dtype ``numpy.ndarray`` is 833 bytes on disk and 4.6 GB in memory) are not admitted.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import os
import stat
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from backend.errors import CheckpointError

from .bounded_pickle import UnsafeCheckpointError, bounded_loads

#: Caps on what a file may make us read or build (real files are far below them).
MAX_METADATA_BYTES = 1 << 30  # DCP .metadata: 31 KB for the quickstart; ~2 MB for a 4B model at dp 8
MAX_META_JSON_BYTES = 64 << 20  # meta.json: a few KB (the run's config, the data stream's state)
MAX_RNG_BYTES = 1 << 20  # rng_rank*.pt: 6.6 KB (CPU and CUDA generator states)
MAX_PLAIN_ENTRY_BYTES = 64 << 20  # a non-tensor DCP entry (an int, a float, a list of param groups)
MAX_ARCHIVE_PICKLE_BYTES = 8 << 20  # an archive's data.pkl: ~200 bytes for a tensor, KBs for param groups


class CheckpointFileError(UnsafeCheckpointError):
    """A checkpoint file that is not a plain regular file of plausible size and format."""


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISLNK, "a symbolic link"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str | os.PathLike) -> io.BufferedReader:
    """The file at ``path`` opened for reading, if it is a regular file and not a symlink."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CheckpointFileError(f"{path}: refusing a symbolic link inside a checkpoint") from None
        if e.errno == errno.ENOENT:
            raise CheckpointError(f"{path}: no such file") from None
        raise CheckpointError(f"{path}: cannot open ({e.strerror})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise CheckpointFileError(f"{path}: refusing a checkpoint file that is {_kind(mode)}")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | os.PathLike, limit: int) -> bytes:
    """All of a regular, non-symlink file of at most ``limit`` bytes."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise CheckpointFileError(f"{path}: {size:,} bytes, more than the {limit:,} such a file may hold")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise CheckpointFileError(f"{path}: grew past {limit:,} bytes while being read")
    return data


def read_slice(f: io.BufferedReader, offset: int, length: int, where: str) -> bytes:
    """``length`` bytes at ``offset`` of an open regular file, refused if they lie past its end."""
    size = os.fstat(f.fileno()).st_size
    if offset + length > size:
        raise CheckpointFileError(
            f"{where}: the metadata declares bytes {offset:,}..{offset + length:,} of a {size:,}-byte file"
        )
    f.seek(offset)
    data = f.read(length)
    if len(data) != length:
        raise CheckpointFileError(f"{where}: the file ended after {len(data):,} of {length:,} bytes")
    return data


def check_step_dir(path: str | os.PathLike) -> None:
    """A checkpoint's step directory must be a real directory, not a symlink to one elsewhere."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such checkpoint directory") from None
    if stat.S_ISLNK(mode):
        raise CheckpointFileError(
            f"{path}: refusing a checkpoint step directory that is a symbolic link (pass the directory it points to)"
        )
    if not stat.S_ISDIR(mode):
        raise CheckpointFileError(f"{path}: a checkpoint step must be a directory, found {_kind(mode)}")


def archive_pickle(data: bytes, where: str) -> bytes:
    """The ``data.pkl`` of a ``torch.save`` archive whose members are stored, not compressed."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        members = archive.infolist()
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as e:
        raise CheckpointFileError(f"{where}: not a torch.save archive ({type(e).__name__})") from None
    if not data.startswith(b"PK\x03\x04") or min((info.header_offset for info in members), default=0) != 0:
        raise CheckpointFileError(f"{where}: refusing an archive with data before its first member")
    total = 0
    for info in members:
        if info.compress_type != zipfile.ZIP_STORED or info.file_size != info.compress_size:
            raise CheckpointFileError(
                f"{where}: refusing a compressed archive member ({len(info.filename)}-character name, "
                f"{info.file_size:,} bytes from {info.compress_size:,}): torch.save never compresses"
            )
        total += info.file_size
    if total > len(data):
        raise CheckpointFileError(f"{where}: archive members add up to {total:,} bytes in {len(data):,}")
    pickles = [info for info in members if info.filename.endswith("/data.pkl") or info.filename == "data.pkl"]
    if len(pickles) != 1:
        raise CheckpointFileError(f"{where}: a torch.save archive holds one data.pkl, found {len(pickles)}")
    if pickles[0].file_size > MAX_ARCHIVE_PICKLE_BYTES:
        raise CheckpointFileError(
            f"{where}: a data.pkl of {pickles[0].file_size:,} bytes (at most {MAX_ARCHIVE_PICKLE_BYTES:,})"
        )
    return archive.read(pickles[0])


def scan_archive(data: bytes, where: str) -> None:
    """Check a ``torch.save`` archive before a loader reads it: stored members, and a ``data.pkl``
    without shared containers, deep nesting or more objects than its size allows. Structure only:
    every global becomes a placeholder here; which globals may load is the loader's rule
    (``weights_only`` for tensors, none at all for plain entries)."""
    bounded_loads(archive_pickle(data, where), where=where, allow=lambda module, name: True, scan=True, persistent=True)


#: The only globals plain data needs: how pickle protocol 2 (torch.save's) writes ``bytes``, and
#: ``OrderedDict``; both called with plain arguments only (``bounded_pickle``).
_PLAIN_GLOBALS = {("_codecs", "encode"), ("collections", "OrderedDict")}


def load_plain_archive(data: bytes, where: str, what: str = "the entry") -> Any:
    """A ``torch.save`` archive of plain data (numbers, strings, bytes, lists, dicts, tuples, None)."""
    return bounded_loads(
        archive_pickle(data, where), where=where, what=what, allow=lambda module, name: (module, name) in _PLAIN_GLOBALS
    )


@contextlib.contextmanager
def only_torch_safe_globals() -> Iterator[None]:
    """``torch.load(weights_only=True)`` with torch's own allowlist only (its built-in list and what
    torch itself added), for the duration.

    Other packages extend it process-wide (megatron-core adds numpy's array reconstruction); a
    checkpoint must not reach those. Loads run on the main thread at start-up; the list is
    restored afterwards."""
    saved = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals([g for g in saved if _from_torch(g)])
    try:
        yield
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(saved)


def _from_torch(entry: Any) -> bool:
    """An allowlist entry torch added itself (``entry`` is an object or an (object, name) pair)."""
    obj = entry[0] if isinstance(entry, tuple) else entry
    module = getattr(obj, "__module__", "") or ""
    return module == "torch" or module.startswith("torch.")


def load_rng_file(path: Path) -> dict[str, torch.Tensor]:
    """A ``rng_rank*.pt``: {"cpu": uint8 tensor[, "cuda": uint8 tensor]}, or a refusal naming it."""
    data = read_regular(path, MAX_RNG_BYTES)
    scan_archive(data, str(path))
    try:
        with only_torch_safe_globals():
            rng = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointFileError(f"{path}: unreadable RNG state ({type(e).__name__})") from None
    if (
        not isinstance(rng, dict)
        or "cpu" not in rng
        or not set(rng) <= {"cpu", "cuda"}
        or not all(isinstance(v, torch.Tensor) and v.dtype == torch.uint8 and v.dim() == 1 for v in rng.values())
    ):
        raise CheckpointFileError(f"{path}: not an RNG state (a dict of 'cpu' and 'cuda' byte tensors)")
    return rng
