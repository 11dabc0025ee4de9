"""Hugging Face weights on disk: lazy per-tensor reads and a sharded writer, safetensors only.

Reading never loads a whole checkpoint: ``safe_open`` memory-maps each file and ``get`` copies out
one tensor, so importing a 4B model (8 GB in BF16) one parameter at a time peaks at about one
parameter's size in host memory. ``pytorch_model.bin`` files are pickles that run code on load:
they are refused, never opened. The sharded index's file names must be plain names inside the
directory (no ``..`` or absolute paths).

After a load, ``check_consumed`` turns tensors the mapping never asked for into an error: a
checkpoint with extra weights (a classifier head, a bias we do not model) would otherwise be
imported with those weights silently dropped.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from backend.config.hf import SAFETENSORS_INDEX, SAFETENSORS_SINGLE, weights_problem
from backend.errors import CheckpointError

SINGLE = SAFETENSORS_SINGLE
INDEX = SAFETENSORS_INDEX
#: 5 GB, transformers' default shard size.
DEFAULT_MAX_SHARD_BYTES = 5 * 1000**3


class HFCheckpointError(CheckpointError, ValueError):
    """A weights directory we refuse or a tensor we cannot find; names the files and tensors."""


class HFCheckpoint:
    """Lazy access to the tensors of a HF directory (``model.safetensors`` or a sharded index)."""

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        self._handles: dict[Path, object] = {}
        self.consumed: set[str] = set()
        index, single = self.dir / INDEX, self.dir / SINGLE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise HFCheckpointError(f"{index}: not a safetensors index with a 'weight_map' ({e})") from None
            self.location: dict[str, Path] = {}
            for name, file in weight_map.items():
                if not isinstance(file, str) or Path(file).name != file or file in ("", ".", ".."):
                    raise HFCheckpointError(f"{index}: tensor {name!r} points outside the directory: {file!r}")
                path = self.dir / file
                if not path.is_file():
                    raise HFCheckpointError(f"{index}: tensor {name!r} is in {file}, which does not exist")
                self.location[name] = path
        elif single.is_file():
            with safe_open(str(single), framework="pt") as f:
                self.location = dict.fromkeys(f.keys(), single)
        else:
            raise HFCheckpointError(weights_problem(self.dir))

    # ---- reading ---------------------------------------------------------------------------------

    @property
    def files(self) -> list[Path]:
        return sorted(set(self.location.values()))

    def names(self) -> list[str]:
        return sorted(self.location)

    def _handle(self, path: Path):
        if path not in self._handles:
            self._handles[path] = safe_open(str(path), framework="pt")
        return self._handles[path]

    def _where(self, name: str) -> Path:
        if name not in self.location:
            files = ", ".join(p.name for p in self.files)
            raise HFCheckpointError(f"{self.dir}: tensor {name!r} is missing (looked in {files})")
        return self.location[name]

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape, read from the header only."""
        return tuple(self._handle(self._where(name)).get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        """One tensor, in its stored dtype, on the CPU; marks it consumed."""
        path = self._where(name)
        try:
            tensor = self._handle(path).get_tensor(name)
        except Exception as e:  # the index named a file that lacks the tensor
            raise HFCheckpointError(f"{path}: cannot read tensor {name!r}: {e}") from None
        self.consumed.add(name)
        return tensor

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of one tensor, reading only those bytes; marks it consumed.

        A rank filling its FSDP shard of the 151,936-row embedding reads its half, not the whole."""
        path = self._where(name)
        try:
            tensor = self._handle(path).get_slice(name)[start:stop]
        except Exception as e:
            raise HFCheckpointError(f"{path}: cannot read rows {start}:{stop} of tensor {name!r}: {e}") from None
        self.consumed.add(name)
        return tensor

    def get_many(self, names: Iterable[str]) -> list[torch.Tensor]:
        return [self.get(n) for n in names]

    def check_present(self, names: Iterable[str]) -> None:
        """Fail early, before any weight is read, when the mapping needs tensors the files lack."""
        missing = sorted(set(names) - set(self.location))
        if missing:
            files = ", ".join(p.name for p in self.files)
            shown = ", ".join(missing[:10]) + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
            raise HFCheckpointError(f"{self.dir}: {len(missing)} tensor(s) missing from {files}: {shown}")

    def check_consumed(self, ignorable: Iterable[str] = ()) -> None:
        """Error naming every stored tensor that was never read, except those matching ``ignorable``."""
        patterns = [re.compile(p) for p in ignorable]
        left = sorted(n for n in self.location if n not in self.consumed and not any(p.fullmatch(n) for p in patterns))
        if left:
            shown = ", ".join(left[:10]) + (f" and {len(left) - 10} more" if len(left) > 10 else "")
            raise HFCheckpointError(
                f"{self.dir}: {len(left)} tensor(s) in the checkpoint are not used by the model: {shown}"
            )

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> HFCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- writing -----------------------------------------------------------------------------------


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor owning its storage (safetensors refuses views sharing memory)."""
    t = t.detach().to("cpu")
    if not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.contiguous().clone()
    return t


def _plain_file_mode(path: Path) -> None:
    """The mode an ordinary new file gets here (0666 less the umask; 0644 under the usual 022)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def write_sharded(
    tensors: Iterable[tuple[str, torch.Tensor]], out_dir: str | Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
) -> list[Path]:
    """Write tensors as transformers does: ``model.safetensors``, or ``model-0000i-of-0000N`` + index.

    Tensors are taken in order and a shard is written as soon as the next tensor would push it over
    ``max_shard_bytes`` (a tensor larger than that gets a shard of its own), so at most one shard is
    held in memory. Files carry metadata ``{"format": "pt"}``, which transformers expects. Existing
    weight files in ``out_dir`` are refused rather than mixed with the new ones.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stale = sorted(p.name for p in out.glob("model*.safetensors*"))
    if stale:
        raise HFCheckpointError(f"{out}: already holds weights ({', '.join(stale)}); write to an empty directory")
    shards: list[dict[str, torch.Tensor]] = []
    written: list[Path] = []
    current: dict[str, torch.Tensor] = {}
    size = total = 0
    seen: set[str] = set()

    def flush() -> None:
        nonlocal current, size
        if current:
            path = out / f".shard-{len(written):05d}.safetensors.tmp"
            save_file(current, str(path), metadata={"format": "pt"})
            written.append(path)
            shards.append(dict.fromkeys(current))
            current, size = {}, 0

    for name, tensor in tensors:
        if name in seen:
            raise HFCheckpointError(f"tensor {name!r} is written twice")
        seen.add(name)
        t = _own_storage(tensor)
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > max_shard_bytes:
            flush()
        current[name] = t
        size += nbytes
        total += nbytes
    flush()
    if not written:
        raise HFCheckpointError("no tensors to write")
    for path in written:  # safetensors writes 0600; the weights get the mode config.json gets
        _plain_file_mode(path)
    if len(written) == 1:
        final = [out / SINGLE]
        written[0].rename(final[0])
        return final
    n = len(written)
    final = [out / f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map = {}
    for tmp, dst, names in zip(written, final, shards):
        tmp.rename(dst)
        weight_map.update(dict.fromkeys(names, dst.name))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return final + [out / INDEX]
