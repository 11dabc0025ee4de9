"""Rows of Parquet files and Arrow directories, one record batch at a time.

``data.path`` (and ``tools/preprocess_data.py --input``) may be

- a ``.parquet`` file;
- a directory of ``.parquet`` shards (read in name order: ``part-00000.parquet``, ...);
- a directory written by ``datasets.Dataset.save_to_disk`` (``state.json`` lists its
  ``data-XXXXX-of-NNNNN.arrow`` files, Arrow IPC streams, in order). A ``DatasetDict`` directory
  (one sub-directory per split) is refused, naming its splits: point at one of them.

Rows hold the fields JSONL rows do (``text`` / ``data.json_key``, ``input_ids``, ``messages``,
``loss_mask``, ``loss_weight`` and the policy fields) and go through the same ``RowParser``, so
validation and errors are the same; a location reads ``FILE: row N`` (N counted from 0 over the
file). A null is a missing field (Arrow tables have every column in every row).

Memory: only one record batch (``BATCH_ROWS`` rows) is ever turned into Python objects; a file
larger than memory streams through (``build.py`` writes the samples to a ``.bin/.idx`` cache).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from .errors import DataFileError, DataNotFoundError

#: Rows turned into Python objects at a time.
BATCH_ROWS = 1024


def is_arrow_source(path: str | Path) -> bool:
    """A Parquet file, a directory of Parquet shards, or a ``save_to_disk`` directory."""
    path = Path(path)
    if path.suffix == ".parquet":
        return True
    return path.is_dir() and (
        (path / "state.json").is_file() or (path / "dataset_dict.json").is_file() or any(path.glob("*.parquet"))
    )


def arrow_files(path: str | Path) -> list[Path]:
    """The files of an Arrow source, in row order."""
    path = Path(path)
    if path.suffix == ".parquet":
        if not path.is_file():
            raise DataNotFoundError(f"data.path: no such file {path}")
        return [path]
    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if (p / "state.json").is_file())
        raise DataFileError(
            f"{path}: a DatasetDict (splits: {', '.join(splits) or 'none'}); set data.path to one split's directory, "
            f"e.g. {path / (splits[0] if splits else 'train')}"
        )
    if (path / "state.json").is_file():
        try:
            state = json.loads((path / "state.json").read_text(encoding="utf-8"))
            files = [path / entry["filename"] for entry in state["_data_files"]]
        except (ValueError, KeyError, TypeError) as e:
            raise DataFileError(
                f"{path / 'state.json'}: not a datasets save_to_disk state ({type(e).__name__})"
            ) from None
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise DataFileError(f"{path}: state.json lists {', '.join(missing)}, which the directory lacks")
        return files
    shards = sorted(path.glob("*.parquet"))
    if not shards:
        raise DataNotFoundError(f"data.path={path}: no .parquet files and no save_to_disk state.json")
    return shards


def _batches(file: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if file.suffix == ".parquet":
            yield from pq.ParquetFile(file).iter_batches(batch_size=BATCH_ROWS)
            return
        with pa.memory_map(str(file)) as source:
            try:
                reader = pa.ipc.open_stream(source)
            except pa.ArrowInvalid:  # the random-access file format
                source.seek(0)
                reader = pa.ipc.open_file(source)
                for i in range(reader.num_record_batches):
                    yield reader.get_batch(i)
                return
            yield from reader
    except (pa.ArrowException, OSError) as e:
        raise DataFileError(
            f"{file}: not a readable {'Parquet' if file.suffix == '.parquet' else 'Arrow'} file ({e})"
        ) from None


def arrow_rows(path: str | Path) -> Iterator[tuple[str, dict]]:
    """(``FILE: row N``, the row as a dict without its null fields) for every row of the source."""
    for file in arrow_files(path):
        n = 0
        for batch in _batches(file):
            for offset in range(0, batch.num_rows, BATCH_ROWS):
                for row in batch.slice(offset, BATCH_ROWS).to_pylist():
                    yield f"{file}: row {n}", _without_nulls(row)
                    n += 1


def _without_nulls(row: dict) -> dict:
    """The row without null fields, and its messages without null keys (a struct column has every
    key of every row's messages); nulls inside per-token lists are kept (a token with no value)."""
    out = {k: v for k, v in row.items() if v is not None}
    if isinstance(out.get("messages"), list):
        out["messages"] = [
            {k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in out["messages"]
        ]
    return out
