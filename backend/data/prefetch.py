"""The next optimizer window prepared while this one trains.

Planning, reading and collating window k+1 run in a background thread while window k computes
(the planner is pure Python, the collation numpy; a GPU step releases the interpreter while its
kernels run). Nothing about the stream changes: windows come in the same order with the same
plans, because the same iterator produces them, one at a time, in sequence. Only these differ:

- ``state_dict`` is the stream position after the last window *handed out* (the one held ahead
  is not counted), so a checkpoint resumes exactly where training stopped;
- an error raised while preparing a window (a malformed row, a missing file) is raised again,
  with its own type and message, by the ``next()`` that asks for that window: at the step that
  needs it, not before;
- ``last_wait_s`` is how long that ``next()`` waited: ``data_wait_s`` in the step metrics, near
  zero when preparation keeps up.

The thread is a daemon and holds no lock the training thread waits on, so Ctrl-C, SIGTERM and
the end of the process are never held up by a window being prepared.
"""

from __future__ import annotations

import copy
import threading
import time


class PrefetchingIterator:
    """Wraps a window iterator (``DataIterator``): ``next()`` returns the window prepared in the
    background and starts preparing the one after it."""

    def __init__(self, iterator):
        self.iterator = iterator
        self.state = copy.deepcopy(iterator.state_dict())
        self.pending: tuple[threading.Thread, dict] | None = None
        self.last_wait_s = 0.0

    def __iter__(self):
        return self

    def _start(self) -> None:
        box: dict = {}

        def prepare() -> None:
            try:
                data = next(self.iterator)
                box["value"] = (data, copy.deepcopy(self.iterator.state_dict()))
            except BaseException as e:  # handed to the training thread, raised at its next()
                box["error"] = e

        thread = threading.Thread(target=prepare, name="window-prefetch", daemon=True)
        thread.start()
        self.pending = (thread, box)

    def __next__(self):
        if self.pending is None:
            self._start()
        thread, box = self.pending
        start = time.perf_counter()
        thread.join()
        self.last_wait_s = time.perf_counter() - start
        self.pending = None
        if "error" in box:
            raise box["error"]
        data, self.state = box["value"]
        self._start()
        return data

    def quiesce(self) -> None:
        """Wait until the window being prepared is ready (it is kept): the wrapped iterator may then
        be changed, e.g. given a lower token budget, and every rank has planned the same windows
        with the old one."""
        if self.pending is not None:
            self.pending[0].join()

    def _settle(self) -> None:
        """Wait for a window being prepared, so the wrapped iterator is not in use."""
        if self.pending is not None:
            self.pending[0].join()
            self.pending = None

    def state_dict(self) -> dict:
        """The position after the last window handed out (what a resume must continue from)."""
        return copy.deepcopy(self.state)

    def load_state_dict(self, state: dict) -> None:
        self._settle()
        self.iterator.load_state_dict(state)
        self.state = copy.deepcopy(state)


class SyncIterator:
    """The same interface without a thread (``data.prefetch: false``): ``last_wait_s`` is the
    whole preparation time of the window."""

    def __init__(self, iterator):
        self.iterator = iterator
        self.last_wait_s = 0.0

    def __iter__(self):
        return self

    def __next__(self):
        start = time.perf_counter()
        data = next(self.iterator)
        self.last_wait_s = time.perf_counter() - start
        return data

    def quiesce(self) -> None:
        """Nothing is prepared ahead."""

    def state_dict(self) -> dict:
        return self.iterator.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.iterator.load_state_dict(state)
