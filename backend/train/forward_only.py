"""Forward-only passes: per-token log-probabilities of many samples under a token budget.

Two forms, one computation (``loss.outputs.microbatch_logprobs``: logit[label] - logsumexp):

- ``compute_logprobs``: a list of samples, planned with the forward budget
  (``train.forward_max_tokens_per_gpu``), right-padded (or packed, as the planner says), run,
  cropped back to each sample's length and returned in the caller's order on every rank (the
  offline tool, ``tools/compute_logprobs.py``).
- ``fill_logprobs``: the training plan's own microbatches, in place (the policy loss's
  recomputed old log-probabilities and the reference model's): the values land exactly where the
  loss reads them, under the same plan, layout and CP cut, with nothing gathered.

And the validation loss (``validation_loss``): forward-only over a fixed validation set, planned
under the forward budget; ``valid_loss`` = sum over every target token of the set of (loss weight x
cross-entropy) divided by the set's target count from the dataset index: the same number (to
summation order) at any data- or context-parallel size and any plan, like the training loss.

Under pipeline parallelism every microbatch goes through the stages in plan order
(``backend.distributed.pipeline.stage_forward``: a stage receives its input, runs its layers and sends its output on;
no backward, so no 1F1B), and the last stage evaluates it. Its per-sample results reach every rank
the way every data-parallel rank's already do (one gather over the world); filled log-probabilities
stay on the last stage, the only one whose loss reads them; the validation loss is sent from the
last stage to the others.
"""

from __future__ import annotations

import numpy as np
import torch

from backend.data.collate import collate, cp_unshard, packed_cp_unshard
from backend.data.iterator import collate_plan
from backend.data.sample import Sample
from backend.distributed.collectives import all_gather_objects, all_gather_tensors, dist_sum
from backend.distributed.fsdp import forward_only
from backend.distributed.pipeline import broadcast_metrics, stage_forward
from backend.loss.cross_entropy import microbatch_loss_sum, window_normaliser
from backend.loss.outputs import microbatch_hidden, microbatch_logprobs, microbatch_values, placeholder_microbatch


def compute_logprobs(model, samples: list[Sample], env, planner, *, temperature: float = 1.0) -> list[np.ndarray]:
    """For each sample of n tokens, n-1 values: log p(token t | tokens before t), t = 1..n-1, of
    softmax(logits / ``temperature``) (the sampler's distribution at that temperature)."""

    def logprobs(batch):
        return microbatch_logprobs(
            model, batch, env.cp_group, route_rows=batch.sample_ids >= 0, temperature=temperature
        )[0]

    with forward_only(model):
        return per_token_outputs(samples, env, planner, logprobs, model=model)


def compute_values(model, samples: list[Sample], env, planner) -> list[np.ndarray]:
    """A critic's values of each sample of n tokens: n-1 values, the one for target t (the state
    before token t) at t - 1, like ``compute_logprobs``."""
    with forward_only(model):
        return per_token_outputs(
            samples,
            env,
            planner,
            lambda batch: microbatch_values(model, batch, env.cp_group, route_rows=batch.sample_ids >= 0),
            model=model,
        )


def stage_hidden(model, env):
    """A stage's own layers on a microbatch (a stage before the last, under pipeline parallelism)."""
    return lambda batch: microbatch_hidden(model, batch, env.cp_group, route_rows=batch.sample_ids >= 0)


def per_token_outputs(samples: list[Sample], env, planner, evaluate, *, model=None) -> list[np.ndarray]:
    """``evaluate(microbatch)`` -> [rows, s_local] per position, for many samples: planned under the
    forward budget, run, un-cut (CP), cropped to each sample's n-1 targets and returned in the
    caller's order on every rank. ``model``: the model ``evaluate`` runs (needed under pipeline
    parallelism, whose earlier stages run their layers instead)."""
    hidden = stage_hidden(model, env)
    plan = planner([len(s.tokens) for s in samples])
    mine: dict[int, np.ndarray] = {}
    for mb in plan.microbatches(env.dp_rank):
        if mb.is_empty:  # keep FSDP's per-forward collectives in step with the other ranks
            stage_forward(model, placeholder_microbatch(env.cp_size, env.sp_size).to(env.device), env, evaluate, hidden)
            continue
        batch = collate(
            [samples[i] for i in mb.indices], list(mb.indices), mb, cp_rank=env.cp_rank, cp_size=env.cp_size
        )
        batch = batch.to(env.device)
        out = stage_forward(model, batch, env, evaluate, hidden)
        if out is None:  # a stage before the last: its layers ran, the last stage evaluates
            continue
        if batch.is_packed:  # one row: sequence i's targets start at its padded offset
            offsets = batch.cu_seqlens_padded.tolist()
            if env.cp_size > 1:
                segments = [b - a for a, b in zip(offsets, offsets[1:])]
                out = packed_cp_unshard(all_gather_tensors(out, env.cp_group), segments)
            out = out[0].cpu().numpy()
            for offset, index in zip(offsets, mb.indices):
                mine[index] = out[offset : offset + len(samples[index].tokens) - 1].copy()
            continue
        if env.cp_size > 1:
            out = cp_unshard(all_gather_tensors(out, env.cp_group))
        out = out.cpu().numpy()
        for row, index in enumerate(mb.indices):
            mine[index] = out[row, : len(samples[index].tokens) - 1].copy()
    merged: dict[int, np.ndarray] = {}
    for part in all_gather_objects(mine, group=env.group("world")):
        merged.update(part)
    return [merged[i] for i in range(len(samples))]


def fill_logprobs(model, microbatches: list, env, field: str, *, temperature: float = 1.0) -> None:
    """Set ``field`` (``old_logprobs`` or ``ref_logprobs``) of each of this rank's microbatches to
    ``model``'s log-probabilities of its labels at ``temperature``, [rows, s_local] on the model's
    device. Empty microbatches run a placeholder forward, so FSDP's collectives stay in step."""

    def logprobs(batch):
        return microbatch_logprobs(
            model, batch, env.cp_group, route_rows=batch.sample_ids >= 0, temperature=temperature
        )[0]

    hidden = stage_hidden(model, env)
    with forward_only(model):
        for mb in microbatches:
            batch = (placeholder_microbatch(env.cp_size, env.sp_size) if mb.is_empty else mb).to(env.device)
            logp = stage_forward(model, batch, env, logprobs, hidden)
            if not mb.is_empty and logp is not None:  # the last stage's: the one whose loss reads them
                setattr(mb, field, logp)


def validation_loss(model, dataset, ids: np.ndarray, env, planner) -> tuple[float, int]:
    """(valid_loss, target tokens) of ``dataset[ids]``; every rank returns the same values."""
    with forward_only(model):  # resharded after: the next training step's gradients stay right
        plan = planner([int(n) for n in dataset.lengths[ids]])
        local = torch.zeros((), dtype=torch.float64, device=env.device)
        batches = collate_plan(dataset, ids, plan, dp_rank=env.dp_rank, cp_rank=env.cp_rank, cp_size=env.cp_size)
        hidden = stage_hidden(model, env)
        for mb in batches:
            batch = (placeholder_microbatch(env.cp_size, env.sp_size) if mb.is_empty else mb).to(env.device)
            part = stage_forward(model, batch, env, lambda b: microbatch_loss_sum(model, b, env), hidden)
            if part is not None:
                local += part.double()
        tokens = int(dataset.loss_token_counts[ids].sum())
        loss = float(dist_sum(local, env.group("loss")) / window_normaliser(tokens))
        if env.pp_size > 1:  # computed on the last stage
            loss = broadcast_metrics({"loss": loss}, env)["loss"]
        return loss, tokens
