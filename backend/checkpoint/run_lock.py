"""One run per directory: an exclusive lock the kernel releases when the holder dies.

Two runs writing into one ``logger.run_dir`` (or ``checkpoint.dir``) interleave metrics lines and
overwrite each other's checkpoints, and a requeued Slurm job can start before the old one is gone.
The lock is ``flock(2)`` on ``DIR/.run.lock`` through ``filelock`` (``FileLock`` is the kernel lock on
Unix and Windows); the kernel drops it when the process exits or is killed, even by ``kill -9``, so
a crash never leaves a stale lock. The soft fallback (a marker file that outlives a killed
holder) is turned off: a filesystem without ``flock`` is refused, saying so.

The holder (pid, host, start time) is written beside it in ``DIR/.run.lock.holder.json``, so the
second run fails at once with a message naming the directory, the holder's pid and host. The
sidecar is written after the lock is taken (writing into the lock file itself could race a
contender's open), and is only ever read as a hint for that message: the lock decides.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time
from datetime import UTC, datetime
from pathlib import Path

from filelock import FileLock, Timeout

from backend.errors import UserError

LOCK_NAME = ".run.lock"
HOLDER_NAME = ".run.lock.holder.json"


class RunDirLockedError(UserError):
    """Another live process holds the directory."""


class RunLock:
    """An exclusive, non-blocking lock on ``directory`` until ``release()`` or process exit.

    Keep the object referenced for as long as the run lives: dropping it releases the lock.
    """

    def __init__(self, directory: str | Path, *, config_key: str = "logger.run_dir"):
        self.directory = Path(directory)
        self.config_key = config_key
        self.lock_path = self.directory / LOCK_NAME
        self.holder_path = self.directory / HOLDER_NAME
        # thread_local=False: acquired and released from any thread of the one process.
        # fallback_to_soft=False: a marker-file lock would outlive a kill -9; refuse instead.
        self._lock = FileLock(str(self.lock_path), timeout=0, thread_local=False, fallback_to_soft=False)
        self.info: dict | None = None

    @property
    def held(self) -> bool:
        return self._lock.is_locked

    def acquire(self) -> RunLock:
        self.created = not self.directory.exists()  # a failed start may remove what it made
        self.directory.mkdir(parents=True, exist_ok=True)
        try:
            self._lock.acquire(timeout=0)
        except Timeout:
            raise RunDirLockedError(self._locked_message()) from None
        except OSError as e:
            if e.errno in (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP):
                raise RunDirLockedError(
                    f"{self.directory}: cannot lock the directory: its filesystem does not support flock "
                    f"({os.strerror(e.errno)}); set {self.config_key} to a directory on a local or flock-capable "
                    f"filesystem"
                ) from None
            raise
        self.info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": datetime.now(UTC).isoformat(timespec="seconds"),
        }
        tmp = self.holder_path.with_name(f"{HOLDER_NAME}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.info) + "\n")
        os.replace(tmp, self.holder_path)
        return self

    def release(self, *, discard_if_empty: bool = False) -> None:
        """Let the directory go. ``discard_if_empty`` (a start that failed): a directory this lock
        created and that holds nothing but the lock file is removed, so a refused start leaves no
        empty run directory behind."""
        if not self.held:
            return
        try:
            if _read_holder(self.holder_path) == self.info:
                self.holder_path.unlink(missing_ok=True)
        finally:
            self._lock.release(force=True)
        if discard_if_empty and getattr(self, "created", False):
            try:
                if [p.name for p in self.directory.iterdir()] == [LOCK_NAME]:
                    self.lock_path.unlink()
                    self.directory.rmdir()
            except OSError:  # something else appeared, or it went: leave it
                pass

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def _locked_message(self) -> str:
        holder = _read_holder(self.holder_path)
        # The holder writes its sidecar just after taking the lock; an old sidecar (a dead holder's)
        # may still be there for that instant. Wait briefly for a live one before naming it.
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and not _plausibly_alive(holder):
            time.sleep(0.05)
            holder = _read_holder(self.holder_path)
        if holder and _plausibly_alive(holder):
            who = f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')}"
        else:
            who = "a process that has not written its details yet"
        return (
            f"{self.directory}: already in use by another run ({who}); wait for it to finish or stop it, "
            f"or set {self.config_key} to another directory"
        )


def _read_holder(path: Path) -> dict | None:
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def _plausibly_alive(holder: dict | None) -> bool:
    """False only when the holder claims this host and its pid is gone; other hosts cannot be checked."""
    if not holder:
        return False
    if holder.get("host") != socket.gethostname():
        return True
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def acquire_run_lock(directory: str | Path, *, config_key: str = "logger.run_dir") -> RunLock:
    """Lock ``directory`` for this process's life, or raise RunDirLockedError naming the holder."""
    return RunLock(directory, config_key=config_key).acquire()


def hold_run_dirs(cfg, env) -> list[RunLock]:
    """Rank 0 locks ``logger.run_dir`` and the checkpoint directory; every rank learns the outcome.

    Only rank 0 writes into these directories, so only it locks; one all-reduce tells the other
    ranks, so a refused start exits on every rank at once instead of leaving them in a collective.
    """
    from backend.config import checkpoint_dir
    from backend.distributed.collectives import dist_any

    locks: list[RunLock] = []
    error: RunDirLockedError | None = None
    if env.is_main:
        run_dir, ckpt = Path(cfg.logger.run_dir).resolve(), checkpoint_dir(cfg).resolve()
        try:
            locks.append(acquire_run_lock(run_dir, config_key="logger.run_dir"))
            if run_dir != ckpt and run_dir not in ckpt.parents:
                locks.append(acquire_run_lock(ckpt, config_key="checkpoint.dir"))
        except RunDirLockedError as e:
            for lock in locks:
                lock.release()
            error = e
    if dist_any(error is not None, env.device, group=env.group("world")):
        raise error or RunDirLockedError(f"{cfg.logger.run_dir}: held by another run (rank 0 says which)")
    return locks
