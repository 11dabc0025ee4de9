"""Pure planning of one optimizer step's microbatches: lists of ints in, a StepPlan out.

No torch and no filesystem here: the planner runs anywhere, and every rank computes the same
plan locally. ``plan_dynamic`` / ``plan_fixed`` / ``plan_sort_and_stride`` are the public
functions; ``make_planner(name, PlanArgs(...))`` builds one by name.
"""

from .args import DEFAULT_ATTENTION_WEIGHT, DEFAULT_MICROBATCH_OVERHEAD, LAYOUTS, PlanArgs
from .buckets import bucket_length, choose_bucket_edges
from .packing import cp_ranges, segment_lengths
from .plan import EMPTY_MICROBATCH, Microbatch, StepPlan
from .pricing import attention_area, microbatch_cost, pad_multiple, round_up, smallest_budget
from .registry import PLANNERS, Planner, make_planner, plan, plan_dynamic, plan_fixed, plan_sort_and_stride

__all__ = [
    "DEFAULT_ATTENTION_WEIGHT",
    "LAYOUTS",
    "attention_area",
    "cp_ranges",
    "segment_lengths",
    "DEFAULT_MICROBATCH_OVERHEAD",
    "EMPTY_MICROBATCH",
    "PLANNERS",
    "Microbatch",
    "PlanArgs",
    "Planner",
    "StepPlan",
    "bucket_length",
    "choose_bucket_edges",
    "make_planner",
    "microbatch_cost",
    "pad_multiple",
    "plan",
    "plan_dynamic",
    "plan_fixed",
    "plan_sort_and_stride",
    "round_up",
    "smallest_budget",
]
