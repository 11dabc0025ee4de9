"""The one run loop: steps up to ``train.train_iters``, the finished check, stop requests and the
save rule, shared by ``python -m backend.train`` (the data-stream driver, ``Trainer``) and
``python -m backend.rl`` (the GRPO loop over a ``PolicyWorker``).

Stopping: SIGTERM, SIGUSR1 or SIGINT (Ctrl-C) on any rank stops every rank at one step boundary.
A handler only records the signal. After each step all ranks all-reduce (MAX) one flag, so they
agree on the step to stop at, save a checkpoint there and exit cleanly; the job (or Slurm's
requeue) resumes from it. Without the agreement one rank would stop while the others blocked in
the next step's collectives. Ctrl-C is a stop signal too, so an interactive run keeps its work; a
second Ctrl-C aborts at once (KeyboardInterrupt) for when the first one's step never ends.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable

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


def run_steps(engine, one_step: Callable[[], object], save: Callable[[], object], after_step=None) -> str:
    """Call ``one_step()`` (which moves ``engine.step`` on by one) until ``train.train_iters``;
    after each, a stop request agreed by every rank saves (``save()``) and ends the run, else
    ``after_step()`` (evaluation) and the save rule (``engine.should_save``). Returns "finished",
    "preempted" (SIGTERM / SIGUSR1) or "interrupted" (Ctrl-C), the last two after saving the step
    every rank reached."""
    iters = engine.cfg.train.train_iters
    if engine.step >= iters:
        if engine.env.is_main:
            log.warning(
                "this run already finished: step %d of train.train_iters=%d is checkpointed in %s; nothing to "
                "train (raise train.train_iters to continue it)",
                engine.step,
                iters,
                engine.ckpt_dir,
            )
        return "finished"
    stop = StopRequest().install()
    try:
        while engine.step < iters:
            one_step()
            if stop.agreed(engine.env):
                save()
                log.warning(
                    "stop signal (%s) received: saved step %d, exiting to be resumed",
                    stop.signal_name or "on another rank",
                    engine.step,
                )
                return "interrupted" if stop.signal_name == "SIGINT" else "preempted"
            if after_step is not None:
                after_step()
            if engine.should_save():
                save()
        return "finished"
    finally:
        stop.uninstall()
