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
import sys
import threading
import time
from collections.abc import Callable
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


def _call_within(fn: Callable, args: tuple, timeout_s: float):
    """``fn(*args)``, or TimeoutError after ``timeout_s`` seconds (0: no limit). The call runs in a
    daemon thread: Python cannot stop a thread, so one that never returns is left behind and dies
    with the process (the loop stops on the error); a result is never taken from it later."""
    if not timeout_s:
        return fn(*args)
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # handed to the caller's thread
            box["error"] = e

    thread = threading.Thread(target=run, name="reward", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError
    if "error" in box:
        raise box["error"]
    return box["value"]


def score(
    fn: Callable, spec: str, prompt: str, response: str, row: dict, *, where: str, timeout_s: float = 0.0
) -> float:
    """``fn(prompt, response, row)`` as a finite float, or a ``RewardError`` saying why not
    (``timeout_s`` > 0: also when it has not returned after that many seconds)."""
    start = time.perf_counter()
    try:
        value = _call_within(fn, (prompt, response, row), timeout_s)
    except TimeoutError:
        raise RewardError(
            f"rl.reward={spec}: no result after {time.perf_counter() - start:.1f} s (rl.reward_timeout_s="
            f"{timeout_s:g}) on {where}"
        ) from None
    except Exception as e:
        raise RewardError(f"rl.reward={spec}: raised {type(e).__name__}: {e} (on {where})") from e
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RewardError(f"rl.reward={spec}: returned {value!r} ({type(value).__name__}), not a number (on {where})")
    value = float(value)
    if not math.isfinite(value):
        raise RewardError(f"rl.reward={spec}: returned {value} (on {where}); a reward must be finite")
    return value
