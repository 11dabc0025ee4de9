"""Pure planning of one optimizer step's microbatches: lists of ints in, a StepPlan out.

No torch import here: the planner runs anywhere, and every rank computes the same plan locally.
"""

from .baselines import plan_sort_and_stride
from .buckets import bucket_length, choose_bucket_edges
from .dynamic import plan_dynamic
from .fixed import plan_fixed
from .plan import DEFAULT_MICROBATCH_OVERHEAD, EMPTY_MICROBATCH, Microbatch, StepPlan
from .pricing import microbatch_cost, pad_multiple, round_up

__all__ = [
    "DEFAULT_MICROBATCH_OVERHEAD",
    "EMPTY_MICROBATCH",
    "bucket_length",
    "choose_bucket_edges",
    "Microbatch",
    "StepPlan",
    "microbatch_cost",
    "pad_multiple",
    "plan_dynamic",
    "plan_fixed",
    "plan_sort_and_stride",
    "round_up",
]
