"""A step's peak memory as a function of its largest microbatch, and the token budget that fits.

    peak = a + b x tokens + c x area

``tokens`` is a microbatch's cost (the tokens one GPU holds, padding included: rows x padded
length / cp, or a packed row's length / cp) and ``area`` the query x key pairs its attention
covers on one GPU (rows x L^2 / cp padded, sum of l_i^2 / cp packed). ``a`` is what does not
depend on the microbatch (weights, gradients, optimizer state, buffers), ``b`` activations per
token, ``c`` attention scores where the kernel materialises them (SDPA's math path; 0 for flex and
Transformer Engine, which never hold a score matrix). Pure arithmetic: the probe that measures
the points lives in ``backend.train.memory_probe``.

The fit is least squares, then ``a`` is raised until every probe lies on or under it (a budget is
never chosen from a line that a measured microbatch already exceeds). On CUDA the caller scales
the peaks by the allocator's reserved / allocated ratio first (fragmentation).

The budget: the largest multiple of 64 whose worst plannable microbatch fits ``limit x (1 -
margin)``. Under a budget B a microbatch holds at most B tokens per GPU, whose area is at most B x
min(L, B x cp) (rows of the longest allowed length L); a sequence longer than the budget still
runs, alone (an oversize singleton): L / cp tokens, L^2 / cp area. Both must fit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: Budgets are multiples of this many tokens.
BUDGET_QUANTUM = 64


class BudgetError(ValueError):
    """No budget fits: even the longest allowed sequence alone exceeds the memory limit."""


@dataclass(frozen=True)
class MemoryFit:
    a: float  # bytes
    b: float  # bytes per token
    c: float  # bytes per attention pair
    # The optimizer step's own peak (weights, gradients, state and its temporaries), which does not
    # grow with the microbatch: a step's peak is the larger of it and the forward/backward line.
    floor: float = 0.0

    def predict(self, tokens: float, area: float) -> float:
        return max(self.a + self.b * tokens + self.c * area, self.floor)

    def as_dict(self) -> dict:
        return {
            "a_bytes": self.a,
            "b_bytes_per_token": self.b,
            "c_bytes_per_token_len": self.c,
            "optimizer_floor_bytes": self.floor,
        }


def fit_memory(points: list[tuple[float, float, float]], *, attention: bool = True, floor: float = 0.0) -> MemoryFit:
    """The fit of ``(tokens, area, peak bytes)`` points (at least 3, or 2 without ``attention``),
    with b, c >= 0 and every point on or under it; ``floor``: the optimizer step's peak."""
    pts = np.asarray(points, dtype=np.float64)
    need = 3 if attention else 2
    if len(pts) < need:
        raise ValueError(f"a memory fit needs at least {need} probes, got {len(pts)}")
    columns = [np.ones(len(pts)), pts[:, 0]] + ([pts[:, 1]] if attention else [])
    design = np.stack(columns, axis=1)
    coef, *_ = np.linalg.lstsq(design, pts[:, 2], rcond=None)
    if attention and coef[2] < 0:  # scores not materialised: refit without them
        return fit_memory(points, attention=False, floor=floor)
    b = max(float(coef[1]), 0.0)
    c = max(float(coef[2]), 0.0) if attention else 0.0
    a = float(np.max(pts[:, 2] - b * pts[:, 0] - c * pts[:, 1]))  # every probe on or under the line
    return MemoryFit(a=a, b=b, c=c, floor=floor)


def worst_peak(fit: MemoryFit, budget: int, max_len: int, cp_size: int = 1) -> float:
    """The largest predicted peak of any microbatch a planner may form under ``budget``."""
    full = fit.predict(budget, budget * min(max_len, budget * cp_size))
    if max_len / cp_size > budget:  # the longest sequence runs alone, over the budget
        return max(full, fit.predict(max_len / cp_size, max_len * max_len / cp_size))
    return full


def resolve_budget(
    fit: MemoryFit, limit_bytes: float, margin: float, max_len: int, cp_size: int = 1, ceiling: int = 1 << 30
) -> int:
    """The largest multiple of ``BUDGET_QUANTUM`` whose worst microbatch fits ``limit x (1 - margin)``,
    at most ``ceiling`` (no microbatch holds more than a window's tokens: a flat fit must not
    extrapolate to billions)."""
    usable = limit_bytes * (1.0 - margin)
    singleton = fit.predict(max_len / cp_size, max_len * max_len / cp_size)
    smallest = fit.predict(BUDGET_QUANTUM, BUDGET_QUANTUM * min(max_len, BUDGET_QUANTUM * cp_size))
    if singleton > usable or smallest > usable:
        raise BudgetError(
            f"data.max_seq_length={max_len} does not fit: one sequence of that length is predicted to need "
            f"{singleton / 2**30:.2f} GiB, over the {usable / 2**30:.2f} GiB allowed (train.memory_limit_gib x "
            f"(1 - train.memory_margin)); recompute activations (model.recompute_granularity=selective or full), "
            f"raise parallel.context_parallel_size (each rank then holds 1/cp of it), shorten data.max_seq_length, "
            f"or give the run more memory (train.memory_limit_gib)"
        )
    top = max(1, ceiling // BUDGET_QUANTUM)
    if worst_peak(fit, top * BUDGET_QUANTUM, max_len, cp_size) <= usable:
        return top * BUDGET_QUANTUM
    lo, hi = 1, top  # fits at lo, not at hi
    while hi - lo > 1:  # worst_peak grows with the budget: bisect on multiples of the quantum
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if worst_peak(fit, mid * BUDGET_QUANTUM, max_len, cp_size) <= usable else (lo, mid)
    return lo * BUDGET_QUANTUM
