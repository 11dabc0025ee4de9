"""Tests never read or write the user's working tree: the test configs resolve their run
directory, checkpoints and data cache inside pytest's temporary directory (a quickstart run's
``runs/quickstart/checkpoints`` once loaded into a test's smaller model, failing the suite)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from backend.config import checkpoint_dir, load_config
from tests.conftest import REPO, TINY

CONFIGS = sorted((REPO / "tests" / "configs").glob("*.yaml"))


@pytest.mark.parametrize("config", CONFIGS, ids=[p.name for p in CONFIGS])
def test_test_configs_write_only_under_the_tests_temporary_directory(config, tmp_path_factory):
    base = tmp_path_factory.getbasetemp().resolve()
    cfg = load_config(config)
    for what, path in (
        ("logger.run_dir", cfg.logger.run_dir),
        ("checkpoint dir", checkpoint_dir(cfg)),
        ("data.cache_dir", cfg.data.cache_dir),
    ):
        resolved = Path(path).resolve()
        assert resolved.is_relative_to(base), f"{config.name}: {what}={path} is outside {base}"
        assert not resolved.is_relative_to(REPO), f"{config.name}: {what}={path} is in the repository"


def test_each_test_has_a_run_directory_of_its_own(tmp_path_factory):
    mine = load_config(TINY).logger.run_dir
    assert Path(mine).name.endswith("test_each_test_has_a_run_directory_of_its_own")
    assert not Path(mine).exists()  # made only when a run writes it


def _plant_quickstart_checkpoint(root: Path) -> Path:
    """What command 1 leaves in a working tree, made hostile: a run directory of the quickstart
    with a checkpoint that stops any reader (an unreadable .metadata)."""
    step = root / "runs" / "quickstart" / "checkpoints" / "step_00000020"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"not a checkpoint")
    (step / "meta.json").write_text(json.dumps({"step": 20}))
    (root / "data_cache").mkdir()
    (root / "data_cache" / "embedded.idx").write_bytes(b"poisoned")
    return step


@pytest.mark.distributed
def test_a_tool_run_from_a_tree_with_a_quickstart_run_never_reads_it(tmp_path):
    """compute_logprobs without --checkpoint looks in the config's checkpoint directory: from a
    working tree that holds the quickstart's runs/ and data_cache/ it must find neither (it would
    exit 2 on the planted files)."""
    tree = tmp_path / "tree"
    _plant_quickstart_checkpoint(tree)
    samples = tmp_path / "samples.jsonl"
    samples.write_text(json.dumps({"text": "def f():\n    pass\n"}) + "\n")
    out = tmp_path / "lp.jsonl"
    cmd = [sys.executable, str(REPO / "tools" / "compute_logprobs.py"), TINY, "train.forward_max_tokens_per_gpu=64"]
    cmd += ["--input", str(samples), "--output", str(out)]
    proc = subprocess.run(
        cmd, cwd=tree, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no checkpoint found" in proc.stderr  # it looked in its own, empty run directory
    assert len(json.loads(out.read_text())["logprobs"]) == len("def f():\n    pass\n") - 1
