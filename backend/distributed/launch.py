"""The torchrun command line every launcher in this project uses (one node, a free port)."""

from __future__ import annotations

import sys


def torchrun_command(nproc: int, *target: str, max_restarts: int = 0) -> list[str]:
    """``python -m backend.distributed.torchrun --standalone --nproc-per-node N`` (torchrun, with
    a rendezvous store per restart: ``torchrun.py``) then ``target`` (``-m module ...`` or
    ``script.py ...``); ``max_restarts``: torchrun's ``--max-restarts``."""
    restarts = [f"--max-restarts={max_restarts}"] if max_restarts else []
    return [
        sys.executable,
        "-m",
        "backend.distributed.torchrun",
        "--standalone",
        f"--nproc-per-node={nproc}",
        *restarts,
        *target,
    ]
