"""Stopping: SIGTERM, SIGUSR1 or SIGINT (Ctrl-C) on any rank stops every rank at one step boundary.

A handler only records the signal. After each step all ranks all-reduce (MAX) one flag, so they
agree on the step to stop at, save a checkpoint there and exit cleanly; the job (or Slurm's
requeue) resumes from it. Without the agreement one rank would stop while the others blocked in
the next step's collectives. Ctrl-C is a stop signal too, so an interactive run keeps its work; a
second Ctrl-C aborts at once (KeyboardInterrupt) for when the first one's step never ends.
"""

from __future__ import annotations

import logging
import signal

from backend.distributed.collectives import dist_any

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StopRequest:
    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict = {}

    def install(self) -> StopRequest:
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, _frame) -> None:
        if signum == signal.SIGINT and self.signal_name == "SIGINT":
            raise KeyboardInterrupt("second Ctrl-C: aborting without a checkpoint")
        self.signal_name = signal.Signals(signum).name
        if signum == signal.SIGINT:
            log.warning("Ctrl-C: saving a checkpoint at the end of this step, then exiting (Ctrl-C again aborts)")

    def agreed(self, env) -> bool:
        """True on every rank once any rank has received a stop signal (one tiny all-reduce)."""
        return dist_any(self.signal_name is not None, env.device, group=env.group("world"))
