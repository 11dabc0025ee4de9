"""Parquet trains bitwise like the same rows in JSONL at dp 2 (both sources in one process group;
the dp 1 case and the data-level equality are in tests/unit/test_arrow_data.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from .harness import run_ranks

pytestmark = pytest.mark.distributed


def _both_sources(rank: int, world_size: int, sources: dict, tmp: str) -> dict:
    from backend.distributed.setup import init_distributed
    from tests.unit.test_arrow_data import train_losses

    env = init_distributed(1)
    # Each rank converts the Parquet file into the shared cache (atomic renames): the race is real.
    return {kind: train_losses(env, sources[kind], Path(tmp)) for kind in ("jsonl", "parquet")}


def test_parquet_trains_bitwise_like_jsonl_at_dp2(tmp_path):
    from tests.unit.test_arrow_data import make_rows, write_sources

    sources = write_sources(make_rows(), tmp_path / "sources")
    ranks = run_ranks(_both_sources, 2, tmp_path, sources, str(tmp_path))
    for result in ranks:
        assert len(result["jsonl"]) == 3 and result["parquet"] == result["jsonl"]
