"""Shared fixtures: the embedded data set, built once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "tests" / "configs" / "tiny.yaml")


# The test configs (tests/configs/*.yaml) take their run directory and data cache from these
# variables, so no test reads or writes the user's runs/ (a quickstart's checkpoints there once
# loaded into a test's smaller model) or data_cache/. Each test gets a run directory of its own;
# module-scoped fixtures one per module; a config loaded with neither set fails to resolve.
RUN_DIR_ENV = "BACKEND_TEST_RUN_DIR"
DATA_CACHE_ENV = "BACKEND_TEST_DATA_CACHE"


@pytest.fixture(scope="session", autouse=True)
def _test_data_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(DATA_CACHE_ENV, str(tmp_path_factory.mktemp("data_cache")))
        mp.setenv(RUN_DIR_ENV, str(tmp_path_factory.getbasetemp() / "runs" / "session"))
        yield


@pytest.fixture(scope="module", autouse=True)
def _module_run_dir(request, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(RUN_DIR_ENV, str(tmp_path_factory.getbasetemp() / "runs" / request.module.__name__))
        yield


@pytest.fixture(autouse=True)
def _test_run_dir(request, tmp_path_factory, monkeypatch):
    """A run directory for this test alone (created only if the test's run writes it)."""
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in request.node.nodeid)[-120:]
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path_factory.getbasetemp() / "runs" / name))


@pytest.fixture(scope="session")
def embedded_cache() -> str:
    """A data cache directory holding the embedded data set (built offline, once): the test
    configs' own ``data.cache_dir``."""
    import os

    from backend.data.embedded import build_embedded

    cache = os.environ[DATA_CACHE_ENV]
    build_embedded(cache)
    build_embedded(cache, 1024)  # the quickstart's, cut at line boundaries
    return cache


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
    shutdown_distributed(env)
    os.environ.clear()
    os.environ.update(saved)
