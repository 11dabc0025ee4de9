"""The one collective around planning: every rank must hold the same plan.

Each rank plans locally from the same lengths, so a mismatch means diverged data, config or
code. Gathering (fingerprint, microbatch count) from every rank costs one tiny all-gather and
turns a would-be hang (ranks running different microbatch counts) into an error naming ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from backend.batching import StepPlan


class PlanMismatchError(RuntimeError):
    pass


def check_plan_agreement(plan: StepPlan, group, *, step: int | None = None) -> None:
    world = dist.get_world_size(group)
    if world == 1:
        return
    mine = torch.tensor([int(plan.fingerprint[:15], 16), plan.num_microbatches], dtype=torch.int64)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    gathered = torch.zeros(world * 2, dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(gathered, mine.to(device), group=group)
    flat = gathered.cpu().tolist()
    rows = [tuple(flat[2 * r : 2 * r + 2]) for r in range(world)]
    if len(set(rows)) == 1:
        return
    by_value: dict[tuple, list[int]] = {}
    for rank, row in enumerate(rows):
        by_value.setdefault(row, []).append(rank)
    detail = "; ".join(f"ranks {ranks}: fingerprint {fp:015x}, {n} microbatches" for (fp, n), ranks in by_value.items())
    where = f" at step {step}" if step is not None else ""
    raise PlanMismatchError(f"the step plan differs across ranks{where} ({detail}); data, config or code diverged")


def check_same_arguments(digest: str, *, what: str, group) -> None:
    """Every rank passed the same ``what`` (its ``digest``, e.g. a hash of the rows): an SPMD caller
    that hands ranks different rows would otherwise train a mixture or hang at a collective."""
    if dist.get_world_size(group) == 1:
        return
    from .collectives import all_gather_objects

    digests = all_gather_objects(digest, group=group)
    if len(set(digests)) > 1:
        by_value: dict[str, list[int]] = {}
        for rank, d in enumerate(digests):
            by_value.setdefault(d, []).append(rank)
        detail = "; ".join(f"ranks {ranks}: {d[:12]}" for d, ranks in by_value.items())
        raise PlanMismatchError(
            f"{what} differ across ranks ({detail}): every rank must call the worker with the same arguments"
        )
