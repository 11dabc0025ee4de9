"""From ``data`` config to a dataset: embedded, JSONL, Parquet / Arrow or .bin/.idx, length-limited."""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from pathlib import Path

import numpy as np

from .arrow_rows import arrow_files, arrow_rows, is_arrow_source
from .chat import LazyChatRenderer, chat_template_dir
from .embedded import build_embedded, cut_report
from .errors import DataError, DataFileError, DataNotFoundError
from .indexed import IndexedTokenDataset, indexed_exists, token_dtype, write_indexed
from .jsonl import InMemoryDataset, RowParser, jsonl_rows
from .overlong import LengthLimitedDataset
from .row_fields import RowFields
from .tokenizers import build_tokenizer

CROSS_ENTROPY = RowFields()


def build_dataset(data_cfg, fields: RowFields = CROSS_ENTROPY) -> tuple[LengthLimitedDataset, object]:
    """(dataset, tokenizer). The dataset never yields a sample over data.max_seq_length.

    ``fields`` (``row_fields.row_fields(cfg.loss)``): the policy-gradient fields the run reads,
    requires or refuses; by default a cross-entropy run's (rows carrying them are refused).

    With data.append_eod the tokenizer has an end-of-document id (byte: 256, vocabulary 257) and
    JSONL samples end with it; a .bin/.idx data set must already end every sample with it
    (tools/preprocess_data.py --append-eod), which is checked on a spread of samples.
    """
    append_eod = getattr(data_cfg, "append_eod", False)
    tokenizer = build_tokenizer(data_cfg.tokenizer, eod=append_eod)
    path = data_cfg.path
    if path == "embedded":
        if data_cfg.tokenizer != "byte":
            raise DataError("data.path=embedded is byte-level: set data.tokenizer=byte")
        if append_eod:
            raise DataError(
                "data.append_eod=true: the embedded data set has no end-of-document ids; use a JSONL file or a "
                "prefix written by tools/preprocess_data.py --append-eod"
            )
        cut_at = data_cfg.max_seq_length if getattr(data_cfg, "embedded_cut_lines", False) else None
        prefix = build_embedded(data_cfg.cache_dir, cut_at)
        base = IndexedTokenDataset(prefix)
        base.note = cut_report(prefix)
    elif path.endswith(".jsonl"):
        if not Path(path).is_file():
            raise DataNotFoundError(f"data.path: no such file {path}")
        chat = LazyChatRenderer(chat_template_dir(data_cfg.tokenizer))
        ignored: Counter = Counter()
        parse = RowParser(tokenizer, data_cfg.json_key, chat, append_eod=append_eod, fields=fields, ignored=ignored)
        rows, samples = 0, []
        for where, row in jsonl_rows(path):
            rows += 1
            samples.extend(parse(row, where))
        if not samples:
            raise DataFileError(f"{path}: no samples (the file is empty or blank); point data.path at a data file")
        base = InMemoryDataset(samples, source=path, ignored_fields=ignored)
        base.note = rows_note(rows, len(samples))
    elif is_arrow_source(path):
        base = arrow_dataset(data_cfg, tokenizer, fields)
    elif indexed_exists(path):
        base = IndexedTokenDataset(path, fields)
        check_indexed_vocabulary(base, tokenizer, data_cfg.tokenizer)
    else:
        raise DataNotFoundError(
            f"data.path={path!r}: expected 'embedded', a .jsonl file, a .parquet file, a directory of .parquet "
            f"shards or of datasets' save_to_disk, or the prefix of a .bin/.idx pair"
        )
    return LengthLimitedDataset(base, data_cfg.max_seq_length, data_cfg.overlong), tokenizer


def check_data_path(path: str) -> None:
    """The checks on ``data.path`` that need only the file system (``--print-config`` runs them, as
    a real start does before reading a row): a missing file or a path of no known format."""
    if path == "embedded":
        return
    if path.endswith((".jsonl", ".parquet")) and not Path(path).is_file():
        raise DataNotFoundError(f"data.path: no such file {path}")
    if path.endswith(".jsonl") or is_arrow_source(path) or indexed_exists(path):
        return
    raise DataNotFoundError(
        f"data.path={path!r}: expected 'embedded', a .jsonl file, a .parquet file, a directory of .parquet "
        f"shards or of datasets' save_to_disk, or the prefix of a .bin/.idx pair"
    )


def check_indexed_vocabulary(base: IndexedTokenDataset, tokenizer, spec: str, probes: int = 64) -> None:
    """Refuse a .bin/.idx pair written for a larger vocabulary than the tokenizer's (its ids would
    index past the embedding: an IndexError on CPU, a device-side assert on CUDA), and, when the
    tokenizer has an EOD id, one whose samples do not end with it. Reads ``probes`` tokens."""
    eod = getattr(tokenizer, "eod_id", None)
    # megatron-core's own writer switches to int32 from 65500 ids on (DType.optimal_dtype)
    need = 4 if tokenizer.vocab_size >= 65500 else np.dtype(token_dtype(tokenizer.vocab_size)).itemsize
    if base.token_itemsize > need:
        hint = (
            "; a byte-level set written with --append-eod holds id 256: set data.append_eod=true"
            if spec == "byte" and eod is None
            else ""
        )
        raise DataFileError(
            f"{base.source}: token ids stored in {base.token_itemsize} bytes, more than data.tokenizer={spec}'s "
            f"{tokenizer.vocab_size} ids need ({need}): it was written for another vocabulary{hint}"
        )
    if eod is not None:
        for i in np.unique(np.linspace(0, len(base) - 1, num=min(probes, len(base))).astype(np.int64)):
            if base.lengths[i] and base.last_token(i) != eod:
                raise DataFileError(
                    f"{base.source}: sample {int(i)} ends with id {base.last_token(i)}, not the end-of-document id "
                    f"{eod}, but data.append_eod=true: write the set with tools/preprocess_data.py --append-eod "
                    f"(or set data.append_eod=false)"
                )


def arrow_dataset(data_cfg, tokenizer, fields: RowFields) -> IndexedTokenDataset:
    """A Parquet / Arrow source as a memory-mapped ``.bin/.idx`` in ``data.cache_dir``.

    The rows stream through the JSONL rules (``RowParser``) into ``write_indexed`` one record batch
    at a time, so a source larger than memory trains; the cache is keyed by the files (path, size,
    modification time), the tokenizer, the chat template and every option that changes a sample,
    and is reused by later runs and by every rank (each writes under its own temporary name and
    renames; the marker file comes last)."""
    path = data_cfg.path
    files = arrow_files(path)
    template_dir = chat_template_dir(data_cfg.tokenizer)
    key = {
        "files": [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files],
        "tokenizer": data_cfg.tokenizer,
        "template": _template_stamp(template_dir),
        "json_key": data_cfg.json_key,
        "append_eod": bool(getattr(data_cfg, "append_eod", False)),
        "fields": [sorted(fields.read), sorted(fields.required), sorted(fields.refuse)],
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    prefix = Path(data_cfg.cache_dir) / f"arrow_{Path(path).stem}_{digest}"
    marker = Path(f"{prefix}.json")
    if not (marker.is_file() and indexed_exists(prefix)):
        ignored: Counter = Counter()
        parse = RowParser(
            tokenizer,
            data_cfg.json_key,
            LazyChatRenderer(template_dir),
            append_eod=key["append_eod"],
            fields=fields,
            ignored=ignored,
        )
        rows = Counter()

        def samples():
            for where, row in arrow_rows(path):
                rows["rows"] += 1
                yield from parse(row, where)

        count = write_indexed(prefix, samples(), tokenizer.vocab_size)
        if not count:
            raise DataFileError(f"{path}: no rows; point data.path at a data file")
        tmp = marker.with_suffix(f".json.tmp{os.getpid()}")
        tmp.write_text(json.dumps({"source": str(path), "rows": rows["rows"], "samples": count, "ignored": ignored}))
        os.replace(tmp, marker)
    info = json.loads(marker.read_text())
    base = IndexedTokenDataset(prefix, fields)
    base.source = str(path)
    base.ignored_fields = dict(info["ignored"])
    base.note = rows_note(info["rows"], info["samples"])
    return base


def rows_note(rows: int, samples: int) -> str:
    """What the start-up summary says when rows became more samples (a chat template that rewrites
    earlier turns gives one sample per assistant turn), else nothing."""
    if samples == rows:
        return ""
    return (
        f"{rows:,} rows as {samples:,} samples: one per assistant turn where the chat template rewrites earlier turns"
    )


def _template_stamp(template_dir: Path | None) -> list:
    """What identifies a chat template on disk (the files it may come from, by size and time)."""
    if template_dir is None:
        return []
    files = [template_dir / "chat_template.jinja", template_dir / "tokenizer_config.json"]
    return [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file()]
