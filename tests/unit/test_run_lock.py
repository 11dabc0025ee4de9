"""One run per directory (backend.checkpoint.run_lock), across real processes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from backend.checkpoint.run_lock import HOLDER_NAME, RunDirLockedError, RunLock, acquire_run_lock
from backend.errors import UserError

REPO = Path(__file__).resolve().parents[2]

HOLD = """
import sys, time
from backend.checkpoint.run_lock import acquire_run_lock
lock = acquire_run_lock(sys.argv[1])
print("locked", flush=True)
time.sleep(600)
"""

TRY = """
import sys
from backend.errors import run_main
from backend.checkpoint.run_lock import acquire_run_lock
sys.exit(run_main(lambda: print("acquired", acquire_run_lock(sys.argv[1]).info["pid"])))
"""


def python(code: str, *args: str, **kw):
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def start_holder(run_dir: Path) -> subprocess.Popen:
    holder = python(HOLD, str(run_dir))
    assert holder.stdout.readline().strip() == "locked", holder.stderr.read()
    return holder


def test_a_second_process_is_refused_naming_the_holder_and_a_kill_9_leaves_no_stale_lock(tmp_path):
    run_dir = tmp_path / "run"
    holder = start_holder(run_dir)
    try:
        second = python(TRY, str(run_dir))
        out, err = second.communicate(timeout=60)
        assert second.returncode == 2, (out, err)
        line = err.strip()
        assert line.startswith(f"error: {run_dir}: already in use by another run")
        assert f"pid {holder.pid} on host {socket.gethostname()}" in line and "logger.run_dir" in line
        assert "\n" not in line
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)

    # The holder died without releasing; its sidecar is still there, the kernel lock is not.
    assert json.loads((run_dir / HOLDER_NAME).read_text())["pid"] == holder.pid
    third = python(TRY, str(run_dir))
    out, err = third.communicate(timeout=60)
    assert third.returncode == 0, err
    assert out.split() == ["acquired", str(third.pid)]


def test_in_process_lock_release_and_reacquire(tmp_path):
    lock = acquire_run_lock(tmp_path / "r", config_key="checkpoint.dir")
    assert lock.held and json.loads((tmp_path / "r" / HOLDER_NAME).read_text())["pid"] == os.getpid()
    with pytest.raises(RunDirLockedError, match=r"pid \d+ on host .*checkpoint\.dir") as err:
        RunLock(tmp_path / "r", config_key="checkpoint.dir").acquire()
    assert isinstance(err.value, UserError)
    lock.release()
    assert not lock.held and not (tmp_path / "r" / HOLDER_NAME).exists()
    with RunLock(tmp_path / "r") as again:
        assert again.held
    assert not again.held
