"""The embedded default data set: the running interpreter's standard-library source code.

Needs no download. Each source file is cut before every top-level ``def``/``class`` (with its
decorators), giving thousands of real documents with a long tail (median about 450 bytes, 16%
over 2,048). Tokenised byte-level and cached as ``.bin/.idx`` on first use.

With ``data.embedded_cut_lines`` (the quickstart sets it) a definition longer than
``data.max_seq_length`` is cut at line boundaries into documents that fit, so a run trains on
all of the text: truncating at the quickstart's 1,024 keeps 3.4 M of the 11.3 M tokens (the heads
of 1,893 long definitions); cut, 11.1 M tokens in 14,926 documents (p50 978 instead of 467), about
1.35x the tokens per step. The cut set is cached under its own name, with its count beside it.
"""

from __future__ import annotations

import json
import os
import re
import sysconfig
from pathlib import Path

import numpy as np

from .indexed import indexed_exists, write_indexed
from .sample import Sample

_TOP_LEVEL = re.compile(rb"^(?:async def |def |class |@)")


def split_source(source: bytes) -> list[bytes]:
    """Cut a module before each top-level definition; a decorator run stays with its definition."""
    parts, current, prev_decorator = [], [], False
    for line in source.splitlines(keepends=True):
        starts = bool(_TOP_LEVEL.match(line))
        if starts and not prev_decorator and current:
            parts.append(b"".join(current))
            current = []
        current.append(line)
        prev_decorator = line.startswith(b"@")
    if current:
        parts.append(b"".join(current))
    return [p for p in parts if p.strip()]


def stdlib_source_files() -> list[str]:
    """The running interpreter's standard-library .py files, sorted: real, long-tailed documents."""
    root = sysconfig.get_paths()["stdlib"]
    skip = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        found.extend(os.path.join(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted(found)


def embedded_documents() -> list[bytes]:
    docs = []
    for path in stdlib_source_files():
        docs.extend(split_source(Path(path).read_bytes()))
    return docs


def cut_at_lines(doc: bytes, max_len: int) -> list[bytes]:
    """``doc`` as consecutive pieces of at most ``max_len`` bytes, cut between lines (a single
    line longer than that is cut inside it); joined, they are ``doc`` again."""
    if len(doc) <= max_len:
        return [doc]
    pieces, current = [], b""
    for line in doc.splitlines(keepends=True):
        while len(line) > max_len:  # one overlong line: cut inside it
            if current:
                pieces.append(current)
                current = b""
            pieces.append(line[:max_len])
            line = line[max_len:]
        if len(current) + len(line) > max_len:
            pieces.append(current)
            current = b""
        current += line
    if current:
        pieces.append(current)
    return [p for p in pieces if p]


def build_embedded(cache_dir: str | Path, cut_at: int | None = None) -> str:
    """Build (once) and return the .bin/.idx prefix of the embedded data set; with ``cut_at``,
    definitions longer than that cut at line boundaries (``cut_report`` says how many)."""
    name = "embedded_stdlib_byte" if cut_at is None else f"embedded_stdlib_byte_lines{cut_at}"
    prefix = str(Path(cache_dir) / name)
    if not indexed_exists(prefix):
        docs = embedded_documents()
        cut = 0
        if cut_at is not None:
            pieces = []
            for doc in docs:
                parts = cut_at_lines(doc, cut_at)
                cut += len(parts) > 1
                pieces.extend(parts)
            docs = pieces
        samples = (Sample(tokens=np.frombuffer(d, dtype=np.uint8).astype(np.int64)) for d in docs)
        count = write_indexed(prefix, samples, vocab_size=256)
        if cut_at is not None:
            tmp = Path(f"{prefix}.cut.json.tmp{os.getpid()}")
            tmp.write_text(json.dumps({"documents": count, "definitions_cut": cut, "cut_at": cut_at}))
            os.replace(tmp, f"{prefix}.cut.json")
    return prefix


def cut_report(prefix: str) -> str:
    """``"1,893 definitions over 1024 tokens cut at line boundaries"``, or "" (none cut, or unknown)."""
    try:
        info = json.loads(Path(f"{prefix}.cut.json").read_text())
    except (OSError, ValueError):
        return ""
    if not info.get("definitions_cut"):
        return ""
    return f"{info['definitions_cut']:,} definitions over {info['cut_at']} tokens cut at line boundaries"
