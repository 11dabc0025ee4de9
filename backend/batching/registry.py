"""Planners by name: one small registry, so the trainer, tools and benchmarks pick a planner by a
string (``dynamic``, ``fixed``, ``sort_and_stride``) with one ``PlanArgs`` bundle."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from .args import PlanArgs
from .baselines import sort_and_stride
from .dynamic import dynamic
from .fixed import fixed
from .plan import StepPlan
from .pricing import check_lengths

Planner = Callable[[Sequence[int]], StepPlan]

PLANNERS: dict[str, Callable[[list[int], PlanArgs], StepPlan]] = {
    "dynamic": dynamic,
    "fixed": fixed,
    "sort_and_stride": sort_and_stride,
}


def plan(kind: str, lengths: Sequence[int], args: PlanArgs) -> StepPlan:
    """Plan one window with the planner named ``kind``."""
    try:
        fn = PLANNERS[kind]
    except KeyError:
        raise ValueError(f"unknown planner {kind!r}; choose one of {', '.join(PLANNERS)}") from None
    return fn(check_lengths(lengths), args)


def make_planner(kind: str, args: PlanArgs) -> Planner:
    """A function from a window's lengths to its plan (what the data iterator calls every step)."""
    if kind not in PLANNERS:
        raise ValueError(f"unknown planner {kind!r}; choose one of {', '.join(PLANNERS)}")
    return functools.partial(plan, kind, args=args)


def plan_dynamic(lengths: Sequence[int], **args) -> StepPlan:
    """Dynamic batching under ``max_tokens_per_gpu`` (keyword arguments: the fields of ``PlanArgs``:
    dp_size, cp_size=1, sp_size=1, max_tokens_per_gpu, pad_to_multiple=1, overhead, bucket_edges,
    layout="padded" | "packed", attention_weight)."""
    return plan("dynamic", lengths, PlanArgs(**args))


def plan_fixed(lengths: Sequence[int], **args) -> StepPlan:
    """Fixed ``micro_batch_size`` (keyword arguments: dp_size, cp_size=1, sp_size=1, micro_batch_size,
    pad_to_multiple=1, overhead, layout)."""
    return plan("fixed", lengths, PlanArgs(**args))


def plan_sort_and_stride(lengths: Sequence[int], **args) -> StepPlan:
    """The sort-and-stride baseline (keyword arguments as ``plan_dynamic``)."""
    return plan("sort_and_stride", lengths, PlanArgs(**args))
