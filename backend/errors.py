"""User errors, and what the command line does with them.

A *user error* is one the user fixes by changing a config key, a data file or a checkpoint, not
the code: a bad config value, a malformed JSONL line, a truncated ``.idx``, a checkpoint that
does not match the run, a run directory held by another run. For those a 30-line traceback only
buries the one line that matters, so the entry point prints ``error: <message>`` on stderr and
exits with status 2 (argparse's status for usage errors). Anything else is a bug and keeps its
traceback. ``BACKEND_DEBUG=1`` brings the traceback back for user errors too.

Every user error's message names what to change: the file (with line or sample where there is
one) and the dotted config key.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable

#: Exit status for a user error (argparse uses 2 for usage errors; an uncaught exception gives 1).
USER_ERROR_EXIT = 2


class UserError(Exception):
    """An error the user fixes in the config, the data or the checkpoint; printed as one line."""


class CheckpointError(UserError):
    """A checkpoint that cannot be (safely) loaded or does not match this run."""


def is_user_error(exc: BaseException) -> bool:
    return isinstance(exc, UserError)


def one_line(exc: BaseException) -> str:
    """The message on one line (a multi-line message keeps every line, joined by '; ')."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return "; ".join(lines) or type(exc).__name__


def run_main(fn: Callable[[], int | None], debug_env: str = "BACKEND_DEBUG") -> int:
    """Call ``fn()`` and return its exit status (``None`` counts as 0).

    A user error prints ``error: <message>`` on stderr, preceded by the traceback only when the
    environment variable ``debug_env`` is set (to anything but '' or '0'), and returns 2. Any
    other exception propagates unchanged: it is a bug, and its traceback is the report.
    """
    try:
        status = fn()
    except Exception as exc:
        if not is_user_error(exc):
            raise
        if os.environ.get(debug_env, "") not in ("", "0"):
            traceback.print_exc(file=sys.stderr)
        print(f"error: {one_line(exc)}", file=sys.stderr, flush=True)
        return USER_ERROR_EXIT
    return 0 if status is None else int(status)
