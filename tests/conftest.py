"""Shared fixtures: the embedded data set, built once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "tests" / "configs" / "tiny.yaml")


@pytest.fixture(scope="session")
def embedded_cache(tmp_path_factory) -> str:
    """A data cache directory holding the embedded data set (built offline, once)."""
    from backend.data.embedded import build_embedded

    cache = tmp_path_factory.mktemp("data_cache")
    build_embedded(cache)
    return str(cache)
