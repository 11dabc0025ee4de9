"""Spawn N gloo ranks on a free local port with a time limit; surface any rank's traceback."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback
from pathlib import Path

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank: int, world_size: int, port: int, out_dir: str, args: tuple, backend: str = "gloo") -> None:
    import torch.distributed as dist

    from backend.distributed.teardown import end_process_groups

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    except BaseException:
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:  # in order: the ranks agree they are done (unless this one failed), sub-groups first
        end_process_groups()


def run_ranks(fn, world_size: int, tmp_path: Path, *args, timeout: float = 240.0, backend: str = "gloo") -> list:
    """Run ``fn(rank, world_size, *args)`` on every rank; return each rank's result, in rank order."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world_size, port, str(tmp_path), args, backend))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    errors = {
        r: (tmp_path / f"rank{r}.err").read_text() for r in range(world_size) if (tmp_path / f"rank{r}.err").exists()
    }
    if errors:
        raise AssertionError("\n".join(f"--- rank {r} failed:\n{tb}" for r, tb in errors.items()))
    if hung:
        raise AssertionError(f"ranks {hung} did not finish within {timeout} s")
    bad = [r for r, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        raise AssertionError(f"ranks {bad} exited with codes {[procs[r].exitcode for r in bad]}")
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
