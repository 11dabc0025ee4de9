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
import queue
import sys
import threading
import time
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
    """A batch of reward calls: the values so far, the first error, when the last call returned."""

    def __init__(self, fn: Callable, calls: Sequence[tuple]) -> None:
        self.fn, self.calls = fn, list(calls)
        self.values: list = []
        self.error: BaseException | None = None
        self.last = time.perf_counter()  # when the call under way started (the one before returned)
        self.done = threading.Event()


class _RewardThread:
    """One daemon thread running the reward calls handed to it, in order: a step's calls cost one
    hand-over per batch (the caller sleeps until the batch ends or a call overruns), not a
    thread's start and join per call (64 of those a step were 8 ms of the tiny GRPO demo's 60 ms
    step). A call that does not return in time keeps its thread, which is then abandoned (daemon:
    it dies with the process) and the next batch gets a new one."""

    def __init__(self) -> None:
        self.tasks: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="reward", daemon=True).start()

    def _serve(self) -> None:
        while True:
            batch: _Batch = self.tasks.get()
            batch.last = time.perf_counter()
            try:
                for args in batch.calls:
                    batch.values.append(batch.fn(*args))
                    batch.last = time.perf_counter()
            except BaseException as e:  # handed to the caller's thread; the batch stops there
                batch.error = e
            batch.done.set()

    def results(self, fn: Callable, calls: Sequence[tuple], timeout_s: float) -> list[tuple[str, object]]:
        """("value", v) of each call in order, up to the first ("error", e) or ("timeout", None):
        a call that has not returned ``timeout_s`` seconds after the one before it did."""
        batch = _Batch(fn, calls)
        self.tasks.put(batch)
        timed_out = False
        while not batch.done.wait(max(0.0, batch.last + timeout_s - time.perf_counter())):
            if time.perf_counter() - batch.last >= timeout_s:
                timed_out = True
                break
        out: list[tuple[str, object]] = [("value", v) for v in list(batch.values)]
        if timed_out:
            out.append(("timeout", None))
        elif batch.error is not None:
            out.append(("error", batch.error))
        return out


_worker: _RewardThread | None = None
_worker_lock = threading.Lock()


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
        done = _worker.results(fn, calls, timeout_s)
        if done and done[-1][0] == "timeout":
            _worker = None  # stuck in the user's function: abandoned, the next batch starts another
    yield from done


def score_all(fn: Callable, spec: str, calls: Sequence[tuple[str, str, dict, str]], *, timeout_s: float = 0.0):
    """``fn(prompt, response, row)`` of each (prompt, response, row, where) as finite floats, in
    order, or a ``RewardError`` on the first call that fails, saying why (``timeout_s`` > 0: also
    when a call has not returned that many seconds after the one before it)."""
    out = []
    start = time.perf_counter()
    for (kind, value), (_, _, _, where) in zip(_results(fn, [c[:3] for c in calls], timeout_s), calls):
        if kind == "timeout":
            raise RewardError(
                f"rl.reward={spec}: no result after {time.perf_counter() - start:.1f} s (rl.reward_timeout_s="
                f"{timeout_s:g}) on {where}"
            )
        if kind == "error":
            if not isinstance(value, Exception):  # KeyboardInterrupt, SystemExit: not the reward's error
                raise value
            raise RewardError(f"rl.reward={spec}: raised {type(value).__name__}: {value} (on {where})") from value
        out.append(_checked(value, spec, where))
        start = time.perf_counter()
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
