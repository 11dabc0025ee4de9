"""Rewind ``metrics.jsonl`` to a checkpoint before a resumed run appends to it.

A run killed after step 120 whose newest checkpoint is step 100 has written rows 101..120; the
resumed run recomputes those steps and would append them again, so every plot and every
"equal to an uninterrupted run" comparison would see two rows per step. Dropping the rows after
the checkpoint's step first keeps one row per step. A kill can also land mid-write, leaving a
last line without its newline (often not even valid JSON); it is dropped and counted, so the
next append starts on a line of its own.

The file is rewritten to a temporary file in the same directory and renamed over the original
(``os.replace``), so a kill during the rewind leaves either the old file or the new one.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


def rewind_metrics(path: str | Path, last_step: int) -> int:
    """Drop rows with ``step > last_step`` (and a truncated last line); return how many were dropped.

    Lines that are not step rows (no integer ``step``, or unparsable lines before the last) are
    kept as they are: this only removes what the resumed run will write again. A missing file
    is nothing to rewind (0).
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return 0
    lines = data.splitlines(keepends=True)
    kept: list[bytes] = []
    dropped = 0
    for i, raw in enumerate(lines):
        is_last = i == len(lines) - 1
        if not raw.strip():
            continue
        try:
            row = json.loads(raw)
        except ValueError:  # includes invalid UTF-8 (UnicodeDecodeError)
            if is_last and not raw.endswith(b"\n"):
                dropped += 1  # cut short by a crash mid-write
                continue
            kept.append(raw)
            log.warning("%s:%d: not a JSON line; kept as it is", path, i + 1)
            continue
        step = row.get("step") if isinstance(row, dict) else None
        if isinstance(step, int) and not isinstance(step, bool) and step > last_step:
            dropped += 1
            continue
        kept.append(raw if raw.endswith(b"\n") else raw + b"\n")
    new = b"".join(kept)
    if new == data:
        return 0
    tmp = path.with_name(f".{path.name}.rewind{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(new)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    if dropped:
        log.info(
            "%s: dropped %d row(s) after step %d, to be written again by the resumed run", path, dropped, last_step
        )
    return dropped
