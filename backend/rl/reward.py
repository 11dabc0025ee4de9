"""The reward function of ``rl.reward``: ``module:function`` (imported) or ``path.py:function``
(a file loaded as a module), called as ``fn(prompt, response, row) -> float``.

A reward that raises, or returns something that is not a finite number, stops the loop before
anything is trained on that step's rollouts, with an error naming the function, the prompt's
file and line, the sample and what happened (the function's own exception is chained).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import numbers
import os
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from backend.config import ConfigError
from backend.errors import UserError


class RewardError(UserError):
    """The reward function failed on a rollout, or returned a non-finite value."""


def load_reward(spec: str) -> Callable:
    """The callable ``spec`` names (see the module docstring)."""
    if not spec or ":" not in spec:
        raise ConfigError(
            f"rl.reward={spec!r}: expected 'module:function' or 'path/to/file.py:function' (called as "
            f"fn(prompt, response, row) -> float)"
        )
    target, name = spec.rsplit(":", 1)
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise ConfigError(f"rl.reward={spec!r}: no such file {path}")
        module_name = f"_backend_rl_reward_{abs(hash(str(path.resolve())))}"
        loader_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[module_name] = module
        try:
            loader_spec.loader.exec_module(module)
        except Exception as e:  # the user's file failed to load (syntax, a missing dependency): one line
            sys.modules.pop(module_name, None)
            raise ConfigError(f"rl.reward={spec!r}: loading {path} raised {type(e).__name__}: {e}") from e
    else:
        try:
            module = importlib.import_module(target)
        except Exception as e:
            raise ConfigError(f"rl.reward={spec!r}: cannot import {target!r} ({type(e).__name__}: {e})") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"rl.reward={spec!r}: {target} has no function {name!r}")
    return fn


class _Batch:
    """A batch of reward calls and how far the thread got: the values so far, the first error, the
    call under way and when it started, and whether the caller gave up on the batch."""

    def __init__(self, fn: Callable, calls: Sequence[tuple]) -> None:
        self.fn, self.calls = fn, list(calls)
        self.values: list = []
        self.error: BaseException | None = None
        # (index of the call under way, when it started), one tuple so it is read whole; while the
        # thread is in that call its index equals len(values)
        self.progress = (0, time.perf_counter())
        self.cancelled = False  # set by the caller on a timeout or an interrupt: make no more calls
        self.done = threading.Event()


class _RewardThread:
    """One daemon thread running the reward calls handed to it, in order: a step's calls cost one
    hand-over per batch (the caller sleeps until the batch ends or a call overruns), not a
    thread's start and join per call (64 of those a step were 8 ms of the tiny GRPO demo's 60 ms
    step). A call that does not return in time keeps its thread, which is then abandoned (daemon:
    it dies with the process; its batch is cancelled, so it makes no further call once the hung
    one returns) and the next batch gets a new one."""

    def __init__(self) -> None:
        self.tasks: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="reward", daemon=True).start()

    def _serve(self) -> None:
        while True:
            batch: _Batch = self.tasks.get()
            try:
                for i, args in enumerate(batch.calls):
                    if batch.cancelled:
                        break
                    batch.progress = (i, time.perf_counter())
                    batch.values.append(batch.fn(*args))
            except BaseException as e:  # handed to the caller's thread; the batch stops there
                batch.error = e
            batch.done.set()

    def results(self, fn: Callable, calls: Sequence[tuple], timeout_s: float) -> list[tuple[str, object]]:
        """("value", v) of each call in order, up to the first ("error", e) or ("timeout",
        seconds): a call that has not returned ``timeout_s`` seconds after it started."""
        batch = _Batch(fn, calls)
        self.tasks.put(batch)
        try:
            while not batch.done.wait(max(0.0, batch.progress[1] + timeout_s - time.perf_counter())):
                current, started = batch.progress
                overrun = time.perf_counter() - started
                if overrun >= timeout_s and len(batch.values) == current:  # still in that call
                    batch.cancelled = True
                    values = batch.values[:current]
                    return [("value", v) for v in values] + [("timeout", overrun)]
        except BaseException:  # an interrupt while waiting: the batch is given up
            batch.cancelled = True
            raise
        out: list[tuple[str, object]] = [("value", v) for v in batch.values]
        if batch.error is not None:
            out.append(("error", batch.error))
        return out


_worker: _RewardThread | None = None
_worker_lock = threading.Lock()


def _forget_worker() -> None:
    """A forked child has no thread behind the parent's queue: it starts its own."""
    global _worker
    _worker = None


os.register_at_fork(after_in_child=_forget_worker)


def _results(fn: Callable, calls: Sequence[tuple], timeout_s: float) -> Iterator[tuple[str, object]]:
    """``fn(*args)`` of each call as ``_RewardThread.results`` gives them; with ``timeout_s`` 0
    (no limit) called here, in order, stopping at the first error."""
    global _worker
    if not timeout_s:
        for args in calls:
            try:
                yield "value", fn(*args)
            except Exception as e:
                yield "error", e
                return
        return
    with _worker_lock:  # one batch at a time: a second caller would queue behind a hung call
        if _worker is None:
            _worker = _RewardThread()
        try:
            done = _worker.results(fn, calls, timeout_s)
        except BaseException:
            _worker = None  # interrupted: its thread may still be in the user's function
            raise
        if done and done[-1][0] == "timeout":
            _worker = None  # stuck in the user's function: abandoned, the next batch starts another
    yield from done


def raised_at(error: BaseException, fn: Callable) -> str:
    """``FILE:LINE`` where ``error`` was raised, in the reward's own file when the traceback passes
    through it (the line the user fixes), else the innermost frame."""
    frames = traceback.extract_tb(error.__traceback__)
    own = getattr(getattr(fn, "__code__", None), "co_filename", None)
    mine = [f for f in frames if f.filename == own]
    frame = (mine or frames or [None])[-1]
    return f"{frame.filename}:{frame.lineno}" if frame is not None else "an unknown line"


def score_all(fn: Callable, spec: str, calls: Sequence[tuple[str, str, dict, str]], *, timeout_s: float = 0.0):
    """``fn(prompt, response, row)`` of each (prompt, response, row, where) as finite floats, in
    order, or a ``RewardError`` on the first call that fails, saying why (``timeout_s`` > 0: also
    when a call has not returned that many seconds after it started)."""
    out = []
    for (kind, value), (_, _, _, where) in zip(_results(fn, [c[:3] for c in calls], timeout_s), calls):
        if kind == "timeout":
            raise RewardError(
                f"rl.reward={spec}: no result after {value:.1f} s (rl.reward_timeout_s={timeout_s:g}) on {where}"
            )
        if kind == "error":
            if not isinstance(value, Exception):  # KeyboardInterrupt, SystemExit: not the reward's error
                raise value
            at = raised_at(value, fn)
            raise RewardError(
                f"rl.reward={spec}: raised {type(value).__name__}: {value} at {at} (on {where})"
            ) from value
        out.append(_checked(value, spec, where))
    return out


def score(
    fn: Callable, spec: str, prompt: str, response: str, row: dict, *, where: str, timeout_s: float = 0.0
) -> float:
    """``fn(prompt, response, row)`` as a finite float, or a ``RewardError`` saying why not
    (``timeout_s`` > 0: also when it has not returned after that many seconds)."""
    return score_all(fn, spec, [(prompt, response, row, where)], timeout_s=timeout_s)[0]


def _checked(value, spec: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RewardError(f"rl.reward={spec}: returned {value!r} ({type(value).__name__}), not a number (on {where})")
    value = float(value)
    if not math.isfinite(value):
        raise RewardError(f"rl.reward={spec}: returned {value} (on {where}); a reward must be finite")
    return value
