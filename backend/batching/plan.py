"""The plan of one optimizer step: per data-parallel rank, the same number of microbatches.

Both planners (fixed micro-batch size and dynamic token budget) return a ``StepPlan``, so the
trainer has one code path and the two differ only in the plan.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from .args import DEFAULT_MICROBATCH_OVERHEAD


@dataclass(frozen=True)
class Microbatch:
    """Sample indices (positions in the window), padded length and priced cost.

    ``padded_len`` is the length every row is right-padded to on this DP rank, before the CP cut;
    ``cost`` is the tokens one GPU holds (rows * padded_len / cp); ``tokens`` the real tokens.
    An empty microbatch (a rank with too few sequences) has no indices and zero everything.
    """

    indices: tuple[int, ...]
    padded_len: int
    cost: int
    tokens: int

    @property
    def is_empty(self) -> bool:
        return not self.indices

    def to_dict(self) -> dict:
        return {
            "indices": list(self.indices),
            "padded_len": self.padded_len,
            "cost": self.cost,
            "tokens": self.tokens,
        }


EMPTY_MICROBATCH = Microbatch(indices=(), padded_len=0, cost=0, tokens=0)


def make_microbatch(indices: tuple[int, ...], padded_len: int, lengths, cp_size: int) -> Microbatch:
    """A microbatch of ``indices`` padded to ``padded_len``, priced per GPU (empty when no indices)."""
    if not indices:
        return EMPTY_MICROBATCH
    return Microbatch(
        indices=indices,
        padded_len=padded_len,
        cost=len(indices) * padded_len // cp_size,
        tokens=sum(lengths[i] for i in indices),
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
            max_tokens_per_gpu=args.budget() if budgeted else None,
            pad_multiple=args.multiple,
            oversize_singletons=oversize,
            kind=kind,
            overhead=args.overhead,
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
            data = [[[list(mb.indices), mb.padded_len] for mb in rank] for rank in self.ranks]
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
        return sum(len(mb.indices) * mb.padded_len for rank in self.ranks for mb in rank)

    @property
    def padding_efficiency(self) -> float:
        padded = self.padded_tokens
        return self.tokens / padded if padded else 1.0

    def slot_costs(self) -> list[int]:
        """The slowest rank's cost in each microbatch slot."""
        return [max(rank[j].cost for rank in self.ranks) for j in range(self.num_microbatches)]

    @property
    def modelled_step_time(self) -> int:
        """Sum over slots of the slowest rank's cost plus a fixed overhead per slot (tokens)."""
        return sum(self.slot_costs()) + self.overhead * self.num_microbatches

    @property
    def rank_imbalance(self) -> float:
        """Slowest rank's total cost over the mean, minus one (0 = perfectly balanced)."""
        totals = [sum(mb.cost for mb in rank) for rank in self.ranks]
        mean = sum(totals) / len(totals)
        return max(totals) / mean - 1.0 if mean else 0.0

    @property
    def distinct_shapes(self) -> int:
        """Distinct (rows, padded_len) tensor shapes: what a compiler or CUDA graph keys on."""
        return len({(len(mb.indices), mb.padded_len) for rank in self.ranks for mb in rank if mb.indices})

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
            padded = sum(len(mb.indices) * mb.padded_len for mb in rank)
            out.append(sum(mb.tokens for mb in rank) / padded if padded else 1.0)
        return out

    def metrics(self) -> dict:
        """The plan's diagnostics, as logged every step and printed by the simulator."""
        return {
            "kind": self.kind,
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
            "max_tokens_per_gpu": self.max_tokens_per_gpu,
            "pad_multiple": self.pad_multiple,
            "kind": self.kind,
            "oversize_singletons": self.oversize_singletons,
            "ranks": [[mb.to_dict() for mb in rank] for rank in self.ranks],
        }
