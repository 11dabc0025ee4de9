"""Rewinding metrics.jsonl to a checkpoint's step (backend.checkpoint.metrics_rewind)."""

from __future__ import annotations

import json
import os

from backend.checkpoint.metrics_rewind import rewind_metrics


def rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def write(path, steps, tail: bytes = b"") -> None:
    path.write_bytes(b"".join(json.dumps({"step": s, "loss": 1.0 / s}).encode() + b"\n" for s in steps) + tail)


def test_drops_rows_after_the_checkpoint_step(tmp_path):
    m = tmp_path / "metrics.jsonl"
    write(m, range(1, 11))
    assert rewind_metrics(m, 6) == 4
    assert [r["step"] for r in rows(m)] == [1, 2, 3, 4, 5, 6]
    assert rewind_metrics(m, 6) == 0  # idempotent


def test_a_truncated_last_line_is_dropped_and_counted(tmp_path):
    m = tmp_path / "metrics.jsonl"
    write(m, range(1, 6), tail=b'{"step": 6, "loss": 0.1')
    assert rewind_metrics(m, 10) == 1
    assert [r["step"] for r in rows(m)] == [1, 2, 3, 4, 5] and m.read_bytes().endswith(b"\n")
    write(m, range(1, 6), tail=b'{"step": 6, "lo\xc3')  # cut inside a UTF-8 sequence
    assert rewind_metrics(m, 3) == 3  # steps 4, 5 and the cut line


def test_a_complete_last_row_missing_its_newline_gets_one(tmp_path):
    m = tmp_path / "metrics.jsonl"
    m.write_bytes(b'{"step": 1}\n{"step": 2}')
    assert rewind_metrics(m, 5) == 0
    assert m.read_bytes() == b'{"step": 1}\n{"step": 2}\n'


def test_other_lines_are_kept_and_a_missing_file_is_fine(tmp_path):
    m = tmp_path / "metrics.jsonl"
    m.write_bytes(b'{"event": "start"}\n{"step": 1}\nnot json\n\n{"step": 2}\n{"step": 3}\n')
    assert rewind_metrics(m, 1) == 2
    assert m.read_bytes() == b'{"event": "start"}\n{"step": 1}\nnot json\n'
    assert rewind_metrics(tmp_path / "absent.jsonl", 3) == 0


def test_the_rewrite_is_a_rename_leaving_no_temporary_file(tmp_path):
    m = tmp_path / "metrics.jsonl"
    write(m, range(1, 4))
    before = os.stat(m).st_ino
    assert rewind_metrics(m, 1) == 2
    assert os.stat(m).st_ino != before  # replaced, not rewritten in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
