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
    build_embedded(cache, 1024)  # the quickstart's, cut at line boundaries
    return str(cache)


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory) -> dict:
    """{kind: (directory, transformers model)} for tiny random Qwen3, Llama and Qwen2 checkpoints
    (safetensors + a tiny ChatML tokenizer), saved once per session."""
    import transformers  # noqa: E402,F401  (a dev dependency: a missing one fails, never skips)

    from tests.helpers.hf_tiny import KINDS, tiny_hf_model

    root = tmp_path_factory.mktemp("tiny_hf")
    return {kind: (root / kind, tiny_hf_model(kind, root / kind, tokenizer=True)) for kind in KINDS}


@pytest.fixture(scope="module")
def world():
    """A one-process gloo world and megatron-core parallel state for in-process model tests,
    undone after the module (environment variables included)."""
    import os

    from backend.distributed.setup import init_distributed, shutdown_distributed

    saved = dict(os.environ)
    env = init_distributed(1)
    yield env
    shutdown_distributed()
    os.environ.clear()
    os.environ.update(saved)
