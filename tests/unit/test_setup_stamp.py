"""tools/setup_env.sh does nothing slow when the venv is up to date: with its stamp in place it
only checks that the packages import (no pip), and the stamp changes with pyproject.toml."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

from tests.conftest import REPO


def _stamp(root) -> str:
    out = subprocess.run(["bash", str(root / "tools" / "setup_env.sh"), "--stamp"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_an_up_to_date_venv_runs_no_pip(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    calls = tmp_path / "calls.txt"
    wrapper = venv / "bin" / "python"
    wrapper.write_text(f'#!/bin/sh\necho "$*" >> {calls}\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    env = dict(os.environ, VENV=str(venv), PYTHONPATH=str(REPO))
    (venv / ".setup_env.stamp").write_text(_stamp(REPO) + "\n")
    start = time.perf_counter()
    out = subprocess.run(["bash", "tools/setup_env.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert time.perf_counter() - start < 30
    assert "pip" not in calls.read_text()  # only the import check ran
    assert out.stdout == "" and "Editable installation" not in out.stderr


def test_the_stamp_follows_pyproject(tmp_path):
    (tmp_path / "tools").mkdir()
    shutil.copy(REPO / "tools" / "setup_env.sh", tmp_path / "tools")
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    first = _stamp(tmp_path)
    assert first == _stamp(REPO)
    with (tmp_path / "pyproject.toml").open("a") as f:
        f.write("\n# a changed dependency list\n")
    assert _stamp(tmp_path) != first
