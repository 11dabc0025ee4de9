"""The quickstart prints no warning a user cannot act on: a short run (training, validation,
checkpoint) has no Python warning and no WARNING log line on stderr."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.distributed


def test_the_quickstart_prints_no_warning(tmp_path, embedded_cache):
    overrides = [
        "train.train_iters=2",
        "train.eval_interval=2",
        "train.eval_samples=4",
        f"data.cache_dir={embedded_cache}",
        f"logger.run_dir={tmp_path / 'run'}",
    ]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"} | {"OMP_NUM_THREADS": "1"}  # as a user runs it
    out = subprocess.run(
        [sys.executable, "-m", "backend.train", "configs/quickstart.yaml", *overrides],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    noisy = [line for line in out.stderr.splitlines() if "Warning" in line or " WARNING " in line]
    assert not noisy, "\n".join(noisy)
    assert "1024 tokens cut at line boundaries" in out.stderr  # whole text, its cutting said once, at start
