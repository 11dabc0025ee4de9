"""Validation loss: forward-only over a fixed validation set, planned under the forward budget.

``valid_loss`` = sum over every target token of the set of (loss weight x cross-entropy) divided
by the set's target count from the dataset index: the same number (to summation order) at any
data- or context-parallel size and any plan, like the training loss.
"""

from __future__ import annotations

import numpy as np
import torch

from backend.data.iterator import collate_plan
from backend.distributed.collectives import dist_sum
from backend.distributed.fsdp import forward_only
from backend.loss.cross_entropy import microbatch_loss_sum, window_normaliser
from backend.loss.outputs import placeholder_microbatch


def validation_loss(model, dataset, ids: np.ndarray, env, planner) -> tuple[float, int]:
    """(valid_loss, target tokens) of ``dataset[ids]``; every rank returns the same values."""
    with forward_only(model):  # resharded after: the next training step's gradients stay right
        plan = planner([int(n) for n in dataset.lengths[ids]])
        local = torch.zeros((), dtype=torch.float64, device=env.device)
        batches = collate_plan(dataset, ids, plan, dp_rank=env.dp_rank, cp_rank=env.cp_rank, cp_size=env.cp_size)
        for mb in batches:
            local += microbatch_loss_sum(
                model, placeholder_microbatch(env.cp_size) if mb.is_empty else mb, env
            ).double()
        tokens = int(dataset.loss_token_counts[ids].sum())
        return float(dist_sum(local, env.group("loss")) / window_normaliser(tokens)), tokens
