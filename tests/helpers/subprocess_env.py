"""The environment for a subprocess a test starts: the test's own (its run directory and data
cache variables, read when the command runs), without the rendezvous of an in-process world
(the ``world`` fixture sets RANK, WORLD_SIZE and MASTER_PORT; a child would try the same port)."""

from __future__ import annotations

import os

DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def subprocess_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    return {**env, **extra}
