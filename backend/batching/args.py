"""The planner's arguments as one typed, validated bundle.

Every planner (dynamic, fixed, sort-and-stride) takes the same world facts (DP and CP sizes, the
pad multiple, the per-microbatch overhead) plus its own size knob (a token budget or a
micro-batch size). Checking them once here gives every planner the same error messages, each
naming the argument, and lets callers build a planner by name (``registry.make_planner``).
"""

from __future__ import annotations

from dataclasses import dataclass

from .pricing import check_budget, check_positive_int, pad_multiple

# Per-microbatch overhead of the step-time model, in token-equivalents: the fixed cost of one
# microbatch (kernel launches, small GEMMs, FSDP all-gather/reduce-scatter). It depends on the
# model and the data-parallel wrapper (the CPU benchmark measures about 400 for the quickstart
# model), so it is a knob: config key train.dynamic_batch_overhead.
DEFAULT_MICROBATCH_OVERHEAD = 2048

# Microbatch layouts: "padded" (rows right-padded to the microbatch's longest) or "packed" (one
# row holding the sequences back to back, attention within each sequence only).
LAYOUTS = ("padded", "packed")

# Attention term of the step-time model, in token-equivalents per token x length: a microbatch's
# modelled time is cost + attention_weight * area / cp + overhead, where area is rows * L^2
# (padded) or sum of per-sequence padded lengths squared (packed). 0 (the default) prices tokens
# only, exactly as before this knob existed; see docs/guides/dynamic-batching.md (Pricing) for how to set it.
DEFAULT_ATTENTION_WEIGHT = 0.0


@dataclass(frozen=True)
class PlanArgs:
    """Everything a planner needs besides the window's lengths."""

    dp_size: int
    cp_size: int = 1
    # The sequence-parallel split: the tensor-parallel size with sequence parallelism, else 1.
    # Rows are aligned to it (with cp: to 2 x cp x sp) and priced over cp x sp GPUs.
    sp_size: int = 1
    # Dynamic and sort-and-stride planners: tokens per GPU and microbatch, padding included.
    max_tokens_per_gpu: int | None = None
    # Fixed planner: sequences per microbatch.
    micro_batch_size: int | None = None
    pad_to_multiple: int = 1
    overhead: int = DEFAULT_MICROBATCH_OVERHEAD
    # Shape buckets (see buckets.choose_bucket_edges); None = exact lengths.
    bucket_edges: tuple[int, ...] | None = None
    # "padded" or "packed" (see LAYOUTS).
    layout: str = "padded"
    # Token-equivalents per token x length (see DEFAULT_ATTENTION_WEIGHT).
    attention_weight: float = DEFAULT_ATTENTION_WEIGHT

    def __post_init__(self) -> None:
        check_positive_int("dp_size", self.dp_size)
        check_positive_int("cp_size", self.cp_size)
        check_positive_int("sp_size", self.sp_size)
        check_positive_int("pad_to_multiple", self.pad_to_multiple)
        o = self.overhead
        if isinstance(o, bool) or not isinstance(o, int) or o < 0:
            raise ValueError(f"overhead must be an integer >= 0 (token-equivalents), got {o!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        w = self.attention_weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not w >= 0 or w == float("inf"):
            raise ValueError(f"attention_weight must be a finite number >= 0 (token-equivalents), got {w!r}")
        if self.bucket_edges is not None:
            object.__setattr__(self, "bucket_edges", tuple(int(e) for e in self.bucket_edges))

    @property
    def multiple(self) -> int:
        """What every sequence is padded to: lcm(pad_to_multiple, 2*cp*sp), or lcm(pad_to_multiple, sp) at cp 1."""
        return pad_multiple(self.pad_to_multiple, self.cp_size, self.sp_size)

    @property
    def cut(self) -> int:
        """The GPUs one row's tokens are split over: cp x sp (a microbatch's cost is its padded
        tokens over this: what one GPU holds after the CP and sequence-parallel cuts)."""
        return self.cp_size * self.sp_size

    def budget(self) -> int:
        """max_tokens_per_gpu, checked to hold at least one aligned row."""
        return check_budget(self.max_tokens_per_gpu, self.multiple, self.cut)

    @property
    def segment_multiple(self) -> int:
        """What each sequence of a packed row is padded to: 2*cp (TE THD layout), or 1 at cp 1."""
        return 2 * self.cp_size if self.cp_size > 1 else 1

    def mbs(self) -> int:
        return check_positive_int("micro_batch_size", self.micro_batch_size)
