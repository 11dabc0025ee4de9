"""The torchrun command line every launcher in this project uses (one node, a free port)."""

from __future__ import annotations

import sys


def torchrun_command(nproc: int, *target: str) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node N`` then ``target``
    (``-m module ...`` or ``script.py ...``)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *target]
