"""The data iterator: for this rank, one optimizer window at a time, planned and collated.

Every rank reads the whole window's lengths from the dataset index and computes the same plan
locally (no collective to plan); it then reads only its own samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from backend.batching import PlanArgs, Planner, StepPlan, choose_bucket_edges, make_planner, pad_multiple
from backend.config.errors import ConfigError

from .collate import MicrobatchTensors, collate
from .sampler import WindowSampler


def bucket_edges_for(train_cfg, lengths, *, cp_size: int, sp_size: int = 1, sample: int = 65536) -> list[int] | None:
    """Bucket edges from the data set's lengths (a seeded sample of them) when max_shapes is set."""
    if not train_cfg.dynamic_batch_max_shapes:
        return None
    lengths = np.asarray(lengths)
    if len(lengths) > sample:
        lengths = lengths[np.random.default_rng(train_cfg.seed).choice(len(lengths), sample, replace=False)]
    multiple = pad_multiple(train_cfg.dynamic_batch_pad_to_multiple, cp_size, sp_size)
    return choose_bucket_edges(lengths.tolist(), train_cfg.dynamic_batch_max_shapes, multiple)


def planner_from_config(train_cfg, dims, *, forward: bool = False, bucket_edges: list[int] | None = None) -> Planner:
    """The training planner (dynamic under train.max_tokens_per_gpu when train.dynamic_batch_enable,
    else fixed train.micro_batch_size), both in train.dynamic_batch_layout (padded or packed) and
    priced with train.dynamic_batch_attention_weight, or with ``forward=True`` the forward-only planner: dynamic
    under train.forward_max_tokens_per_gpu (default: train.max_tokens_per_gpu). A forward budget of
    0 is an error, not a silent fixed plan. ``dims``: the world's ``ParallelDims`` (the planner
    balances over its dp ranks and prices each sequence's cut over its cp x sp ranks)."""
    args = dict(
        dp_size=dims.dp,
        cp_size=dims.cp,
        sp_size=dims.sp,
        pad_to_multiple=train_cfg.dynamic_batch_pad_to_multiple,
        overhead=train_cfg.dynamic_batch_overhead,
        layout=train_cfg.dynamic_batch_layout,
        attention_weight=float(train_cfg.dynamic_batch_attention_weight),
    )
    if "auto" in (train_cfg.max_tokens_per_gpu, train_cfg.forward_max_tokens_per_gpu) and not (
        forward and train_cfg.forward_max_tokens_per_gpu not in (0, "auto")
    ):
        raise ConfigError(
            "train.max_tokens_per_gpu=auto is resolved by the trainer's memory probe (it needs the model); "
            "give a number here (tools/probe_memory.py prints the one the probe chooses)"
        )
    if forward:
        budget = train_cfg.forward_max_tokens_per_gpu or train_cfg.max_tokens_per_gpu
        if not budget:
            raise ValueError(
                "forward-only passes are planned under a token budget: set train.forward_max_tokens_per_gpu "
                "(or train.max_tokens_per_gpu)"
            )
        return make_planner("dynamic", PlanArgs(max_tokens_per_gpu=budget, bucket_edges=bucket_edges, **args))
    if train_cfg.dynamic_batch_enable:
        budget = train_cfg.max_tokens_per_gpu
        return make_planner("dynamic", PlanArgs(max_tokens_per_gpu=budget, bucket_edges=bucket_edges, **args))
    return make_planner("fixed", PlanArgs(micro_batch_size=train_cfg.micro_batch_size, **args))


@dataclass
class StepData:
    """One optimizer window as seen by one rank."""

    window_ids: np.ndarray  # dataset indices of the whole window, in stream order
    plan: StepPlan
    microbatches: list[MicrobatchTensors]  # this rank's, in execution order, CP-cut
    global_loss_tokens: int  # prediction targets in the whole window: the loss normaliser
    # Samples of the window with any target: the policy loss's per-sequence normaliser.
    global_loss_sequences: int = 0

    @property
    def num_microbatches(self) -> int:
        return len(self.microbatches)


def collate_plan(
    dataset, window_ids, plan: StepPlan, *, dp_rank: int, cp_rank: int, cp_size: int
) -> list[MicrobatchTensors]:
    out = []
    for mb in plan.microbatches(dp_rank):
        ids = [int(window_ids[i]) for i in mb.indices]
        out.append(collate([dataset[i] for i in ids], ids, mb, cp_rank=cp_rank, cp_size=cp_size))
    return out


def window_data(dataset, window_ids, planner: Planner, *, dp_rank: int, cp_rank: int, cp_size: int) -> StepData:
    """One window of ``dataset`` (its ``window_ids``, in stream order) planned, collated for this
    rank and counted: the file stream's windows and the RL worker's in-memory rows alike."""
    window_ids = np.asarray(window_ids)
    plan = planner([int(n) for n in dataset.lengths[window_ids]])
    counts = dataset.loss_token_counts[window_ids]
    return StepData(
        window_ids=window_ids,
        plan=plan,
        microbatches=collate_plan(dataset, window_ids, plan, dp_rank=dp_rank, cp_rank=cp_rank, cp_size=cp_size),
        global_loss_tokens=int(counts.sum()),
        global_loss_sequences=int(np.count_nonzero(counts)),
    )


class DataIterator:
    """Yields StepData for (dp_rank, cp_rank), window after window, forever."""

    def __init__(self, dataset, sampler: WindowSampler, planner: Planner, *, dp_rank: int, cp_rank: int, cp_size: int):
        self.dataset = dataset
        self.sampler = sampler
        self.planner = planner
        self.dp_rank, self.cp_rank, self.cp_size = dp_rank, cp_rank, cp_size

    def __iter__(self):
        return self

    def __next__(self) -> StepData:
        window_ids = self.sampler.next_window()
        return window_data(
            self.dataset, window_ids, self.planner, dp_rank=self.dp_rank, cp_rank=self.cp_rank, cp_size=self.cp_size
        )

    def state_dict(self) -> dict:
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])
