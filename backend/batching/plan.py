"""The plan of one optimizer step: per data-parallel rank, the same number of microbatches.

Both planners (fixed micro-batch size and dynamic token budget) return a ``StepPlan``, so the
trainer has one code path and the two differ only in the plan.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from .args import DEFAULT_ATTENTION_WEIGHT, DEFAULT_MICROBATCH_OVERHEAD
from .pricing import attention_area


@dataclass(frozen=True)
class Microbatch:
    """Sample indices (positions in the window), padded length and priced cost.

    Padded layout: ``padded_len`` is the length every row is right-padded to on this DP rank,
    before the CP cut. Packed layout (``packed``): the microbatch is ONE row holding its sequences
    back to back, each padded to a multiple of 2*cp, and ``padded_len`` is that row's total length
    before the CP cut. ``cost`` is the tokens one GPU holds (rows * padded_len / cp), ``tokens``
    the real tokens, ``area`` the query x key pairs its attention covers before the CP cut
    (padded: rows * padded_len^2; packed: the sum of the per-sequence padded lengths squared).
    An empty microbatch (a rank with too few sequences) has no indices and zero everything.
    """

    indices: tuple[int, ...]
    padded_len: int
    cost: int
    tokens: int
    area: int = 0
    packed: bool = False

    @property
    def is_empty(self) -> bool:
        return not self.indices

    @property
    def rows(self) -> int:
        """Rows of the microbatch's tensors: one when packed, one per sequence when padded."""
        if not self.indices:
            return 0
        return 1 if self.packed else len(self.indices)

    @property
    def padded_tokens(self) -> int:
        """Tokens after padding, before the CP cut."""
        return self.rows * self.padded_len

    def to_dict(self) -> dict:
        out = {
            "indices": list(self.indices),
            "padded_len": self.padded_len,
            "cost": self.cost,
            "tokens": self.tokens,
        }
        if self.packed:
            out["layout"] = "packed"
        return out


EMPTY_MICROBATCH = Microbatch(indices=(), padded_len=0, cost=0, tokens=0)


def make_microbatch(indices: tuple[int, ...], padded_len: int, lengths, cp_size: int) -> Microbatch:
    """A padded microbatch of ``indices`` padded to ``padded_len``, priced per GPU (empty when no indices)."""
    if not indices:
        return EMPTY_MICROBATCH
    return Microbatch(
        indices=indices,
        padded_len=padded_len,
        cost=len(indices) * padded_len // cp_size,
        tokens=sum(lengths[i] for i in indices),
        area=attention_area(len(indices), padded_len),
    )


@dataclass(frozen=True)
class StepPlan:
    """Rank-major microbatches (execution order within a rank) plus how the plan was made."""

    ranks: tuple[tuple[Microbatch, ...], ...]
    cp_size: int
    max_tokens_per_gpu: int | None  # None for a fixed micro-batch-size plan
    pad_multiple: int
    oversize_singletons: int = 0
    kind: str = "dynamic"
    overhead: int = DEFAULT_MICROBATCH_OVERHEAD
    attention_weight: float = DEFAULT_ATTENTION_WEIGHT
    layout: str = "padded"
    sp_size: int = 1  # the sequence-parallel split (rows priced over cp_size x sp_size GPUs)
    _fingerprint: str = field(default="", compare=False, repr=False)

    def __post_init__(self) -> None:
        counts = {len(r) for r in self.ranks}
        if len(counts) != 1:
            raise ValueError(f"every rank must run the same number of microbatches, got {sorted(counts)}")

    @classmethod
    def assemble(cls, ranks, args, *, kind: str, budgeted: bool, oversize: int = 0) -> StepPlan:
        """A plan from per-rank microbatch lists and the ``PlanArgs`` it was made under."""
        return cls(
            ranks=tuple(tuple(r) for r in ranks),
            cp_size=args.cp_size,
            sp_size=args.sp_size,
            max_tokens_per_gpu=args.budget() if budgeted else None,
            pad_multiple=args.multiple,
            oversize_singletons=oversize,
            kind=kind,
            overhead=args.overhead,
            attention_weight=args.attention_weight,
            layout=args.layout,
        )

    @property
    def dp_size(self) -> int:
        return len(self.ranks)

    @property
    def num_microbatches(self) -> int:
        return len(self.ranks[0])

    @property
    def fingerprint(self) -> str:
        """A stable digest of the assignment: identical on every rank and every process."""
        if not self._fingerprint:
            data = [
                [[list(mb.indices), mb.padded_len, *(["p"] if mb.packed else [])] for mb in rank] for rank in self.ranks
            ]
            blob = json.dumps(data, separators=(",", ":")).encode()
            object.__setattr__(self, "_fingerprint", hashlib.sha256(blob).hexdigest()[:16])
        return self._fingerprint

    def microbatches(self, dp_rank: int) -> tuple[Microbatch, ...]:
        return self.ranks[dp_rank]

    # ---- metrics -------------------------------------------------------------------------
    @property
    def num_sequences(self) -> int:
        return sum(len(mb.indices) for rank in self.ranks for mb in rank)

    @property
    def tokens(self) -> int:
        """Real tokens of the window, over all ranks (the loss normaliser counts prediction
        targets instead: one fewer per sequence, and only where the loss mask is set)."""
        return sum(mb.tokens for rank in self.ranks for mb in rank)

    @property
    def padded_tokens(self) -> int:
        """Tokens after padding, over all ranks (before the CP cut)."""
        return sum(mb.padded_tokens for rank in self.ranks for mb in rank)

    @property
    def padding_efficiency(self) -> float:
        padded = self.padded_tokens
        return self.tokens / padded if padded else 1.0

    def microbatch_time(self, mb: Microbatch) -> float:
        """A microbatch's modelled compute in token-equivalents: its tokens per GPU plus the
        attention term (attention_weight * area / cp); the per-microbatch overhead is separate."""
        if not self.attention_weight:
            return mb.cost
        return mb.cost + self.attention_weight * mb.area / (self.cp_size * self.sp_size)

    def slot_costs(self) -> list[float]:
        """The slowest rank's modelled time in each microbatch slot (its cost when attention_weight is 0)."""
        return [max(self.microbatch_time(rank[j]) for rank in self.ranks) for j in range(self.num_microbatches)]

    @property
    def modelled_step_time(self) -> float:
        """Sum over slots of the slowest rank's modelled time plus a fixed overhead per slot
        (token-equivalents; an integer when attention_weight is 0)."""
        return sum(self.slot_costs()) + self.overhead * self.num_microbatches

    @property
    def rank_imbalance(self) -> float:
        """Slowest rank's total modelled time over the mean, minus one (0 = perfectly balanced)."""
        totals = [sum(self.microbatch_time(mb) for mb in rank) for rank in self.ranks]
        mean = sum(totals) / len(totals)
        return max(totals) / mean - 1.0 if mean else 0.0

    @property
    def distinct_shapes(self) -> int:
        """Distinct (rows, padded_len) tensor shapes: what a compiler or CUDA graph keys on."""
        return len({(mb.rows, mb.padded_len) for rank in self.ranks for mb in rank if mb.indices})

    @property
    def empty_microbatches(self) -> int:
        return sum(1 for rank in self.ranks for mb in rank if mb.is_empty)

    def over_budget_microbatches(self) -> int:
        """Microbatches of two or more sequences above the budget (always 0 for a dynamic plan)."""
        if self.max_tokens_per_gpu is None:
            return 0
        return sum(
            1 for rank in self.ranks for mb in rank if len(mb.indices) >= 2 and mb.cost > self.max_tokens_per_gpu
        )

    def covers(self, num_samples: int) -> bool:
        """Every window position appears exactly once across all ranks and microbatches."""
        seen = sorted(i for rank in self.ranks for mb in rank for i in mb.indices)
        return seen == list(range(num_samples))

    def rank_padding_efficiencies(self) -> list[float]:
        """Real over padded tokens on each DP rank (1.0 for a rank with only empty microbatches)."""
        out = []
        for rank in self.ranks:
            padded = sum(mb.padded_tokens for mb in rank)
            out.append(sum(mb.tokens for mb in rank) / padded if padded else 1.0)
        return out

    def metrics(self) -> dict:
        """The plan's diagnostics, as logged every step and printed by the simulator."""
        return {
            "kind": self.kind,
            "layout": self.layout,
            "num_microbatches": self.num_microbatches,
            "num_sequences": self.num_sequences,
            "tokens": self.tokens,
            "padded_tokens": self.padded_tokens,
            "padding_efficiency": self.padding_efficiency,
            "padding_efficiency_min_rank": min(self.rank_padding_efficiencies()),
            "modelled_step_time": self.modelled_step_time,
            "rank_imbalance": self.rank_imbalance,
            "distinct_shapes": self.distinct_shapes,
            "empty_microbatches": self.empty_microbatches,
            "oversize_singletons": self.oversize_singletons,
            "over_budget_microbatches": self.over_budget_microbatches(),
            "plan_fingerprint": self.fingerprint,
        }

    def to_dict(self) -> dict:
        """Plain data (contract): num_microbatches, fingerprint, rank-major microbatches."""
        return {
            "num_microbatches": self.num_microbatches,
            "fingerprint": self.fingerprint,
            "dp_size": self.dp_size,
            "cp_size": self.cp_size,
            "sp_size": self.sp_size,
            "max_tokens_per_gpu": self.max_tokens_per_gpu,
            "pad_multiple": self.pad_multiple,
            "kind": self.kind,
            "layout": self.layout,
            "oversize_singletons": self.oversize_singletons,
            "ranks": [[mb.to_dict() for mb in rank] for rank in self.ranks],
        }
