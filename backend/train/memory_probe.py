"""Measure what a microbatch costs in memory on this model, device, layout and kernel, and choose
``train.max_tokens_per_gpu`` from it (``train.max_tokens_per_gpu: auto``).

Runs after the model is built, sharded and its optimizer made, before a checkpoint is read. A
handful of synthetic microbatches go through the real collation, layout (padded or packed), CP
cut and attention kernel, longest first: one sequence of ``data.max_seq_length``, two of them, a
budget of short sequences, a medium mix. Each runs forward, backward and an optimizer step at
learning rate 0 (so gradients, optimizer state and the step's temporaries are counted), under the
meter of ``memory_meter``; then gradients are dropped and the optimizer state is cleared as it was
(the weights are unchanged: a step at lr 0 adds zero). The peaks are fitted by
``backend.batching.memory_fit`` and the budget resolved there, agreed across ranks by the
minimum. On CUDA the peaks are scaled by the worst reserved / allocated ratio seen (fragmentation).

Mixture of experts under expert parallelism: a rank's expert rows depend on where every rank's
tokens are routed (its experts may receive every token of the EP group). Each probe routes every
token of every rank to EP rank 0's experts (``moe_stats.worst_case_routing``), so rank 0 computes
EP x tokens x min(k, E / EP) expert rows, the most any routing can give it; every rank then fits
the worst rank's peaks, so the budget holds for any routing. At EP 1 the expert rows are tokens x
k whatever the routing and nothing changes.

Pipeline parallelism: under 1F1B stage s holds the activations of up to p - s microbatches at once
(``pipeline.in_flight``), in its own layers only. Each probe is then a window of p microbatches of
its shape after the lead, so every stage measures its most in-flight activations with the step's
gradients held; every rank fits the worst stage's peaks (the maximum over the world, as for EP).
The fit's ``tokens`` and ``area`` stay those of one microbatch, so the budget still bounds one
microbatch, and a step's prediction is the fit at its largest microbatch: every in-flight
microbatch is at most that large, so no stage's peak exceeds it (measured: the PP 2 test of
``tests/distributed/test_pipeline_parallel.py`` trains adversarial windows at the budget).

Why these shapes: tokens and attention area must vary independently for the fit to separate b
from c, and the longest sequence must be measured, not extrapolated, because it is the one that
decides whether the run can start at all.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from backend.batching import PlanArgs, make_planner
from backend.batching.memory_fit import MemoryFit, fit_memory, resolve_budget, worst_peak
from backend.data.iterator import StepData, collate_plan
from backend.data.jsonl import InMemoryDataset
from backend.data.sample import Sample
from backend.distributed.collectives import dist_max, dist_max_tensor
from backend.model import moe_stats

from .memory_meter import MemoryMeter, resident_tensors
from .step import forward_backward

log = logging.getLogger(__name__)

GIB = 1 << 30


@dataclass
class ProbeResult:
    fit: MemoryFit
    points: list[tuple[float, float, float]]  # (tokens per GPU, area per GPU, peak bytes)
    limit_bytes: int
    margin: float
    budget: int
    predicted_peak_bytes: float  # the worst microbatch under the budget
    fragmentation: float
    seconds: float

    def as_dict(self) -> dict:
        return {
            "max_tokens_per_gpu": self.budget,
            **self.fit.as_dict(),
            "limit_bytes": self.limit_bytes,
            "margin": self.margin,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "fragmentation": self.fragmentation,
            "points": [list(p) for p in self.points],
            "seconds": self.seconds,
        }

    def summary(self) -> str:
        return (
            f"train.max_tokens_per_gpu=auto -> {self.budget:,}: peak = {self.fit.a / 2**20:,.1f} MiB + "
            f"{self.fit.b / 1024:,.2f} KiB x tokens + {self.fit.c:,.1f} B x attention pairs, at least the "
            f"optimizer step's {self.fit.floor / 2**20:,.1f} MiB "
            f"(x{self.fragmentation:.2f} fragmentation), worst microbatch {self.predicted_peak_bytes / GIB:.2f} GiB "
            f"of {self.limit_bytes / GIB:.2f} GiB x (1 - {self.margin:g}); probed in {self.seconds:.1f} s"
        )


def probe_shapes(max_len: int, quantum: int = 64) -> list[list[int]]:
    """Window lengths of the probes, longest first (one microbatch each)."""
    short = max(quantum, max_len // 16)
    medium = max(quantum, max_len // 4)
    return [
        [max_len],
        [max_len, max_len],
        [short] * max(2, (2 * max_len) // short),
        [medium] * 2 + [short] * 4,
    ]


def _limit_bytes(cfg, meter: MemoryMeter) -> int:
    gib = cfg.train.memory_limit_gib
    if gib:
        return int(gib * GIB)
    capacity = meter.capacity_bytes()
    if capacity is None:
        raise ValueError("train.memory_limit_gib: required on CPU with train.max_tokens_per_gpu=auto")
    return capacity


def _one_microbatch(lengths: list[int], cfg, cp: int, sp: int = 1):
    args = PlanArgs(
        dp_size=1,
        cp_size=cp,
        sp_size=sp,
        max_tokens_per_gpu=2 * len(lengths) * max(lengths),  # everything in one microbatch, padded or packed
        pad_to_multiple=cfg.train.dynamic_batch_pad_to_multiple,
        layout=cfg.train.dynamic_batch_layout,
    )
    one_rank = make_planner("dynamic", args)(list(lengths))
    if len(one_rank.ranks[0]) != 1:
        raise RuntimeError(f"memory probe: the window {lengths} did not plan as one microbatch")
    return one_rank


def _probe_data(lengths: list[int], cfg, env, rng, lead: list[int] | None = None) -> tuple[StepData, object]:
    """One window of synthetic sequences planned as one microbatch on every rank (the same shape);
    under pipeline parallelism ``pp`` such microbatches (see the module docstring).

    ``lead``: the lengths of a microbatch run first, so the probed microbatch runs as a real step's
    second (or later) one does: with the gradients of the earlier microbatches already held
    (unsharded while FSDP2's gradient sync waits for the last microbatch) and the reduce-scatter at
    its end. A step's first microbatch holds no gradients yet; probed alone, the quickstart's line
    sat about 1.5 MiB (its gradients) under a later microbatch of the same shape."""
    cp = env.cp_size
    lead = list(lead or [])
    copies = env.pp_size
    samples = [Sample(tokens=rng.integers(0, 256, size=n).astype(np.int64)) for n in [*lengths * copies, *lead]]
    dataset = InMemoryDataset(samples, source="memory probe")  # any vocabulary: ids below 256
    one_rank = _one_microbatch(lengths, cfg, cp, env.sp_size)
    probed = one_rank.ranks[0][0]
    rank = tuple(
        dataclasses.replace(probed, indices=tuple(c * len(lengths) + i for i in probed.indices)) for c in range(copies)
    )
    if lead:
        first = _one_microbatch(lead, cfg, cp, env.sp_size).ranks[0][0]
        indices = tuple(copies * len(lengths) + i for i in first.indices)
        rank = (dataclasses.replace(first, indices=indices), *rank)
    plan = dataclasses.replace(one_rank, ranks=(rank,) * env.dp_size)
    ids = np.arange(len(samples))
    batches = collate_plan(dataset, ids, plan, dp_rank=0, cp_rank=env.cp_rank, cp_size=cp)
    data = StepData(ids, plan, batches, int(dataset.loss_token_counts.sum()) * env.dp_size, len(samples))
    return data, plan.ranks[0][-1]


def run_probes(model, optimizer, cfg, env, meter: MemoryMeter, shapes: list[list[int]] | None = None):
    """(points, optimizer floor, fragmentation) on this rank: each probe shape's forward/backward
    (tokens, area, peak bytes), and the optimizer step's own peak.

    A small unmeasured step first makes the optimizer state, so every measured probe starts from
    what a real step starts with; each probe then runs as a step's second microbatch, after a
    64-token one (see ``_probe_data``), the worst place in a step for memory. On CUDA the cache is
    emptied before each probe, so a probe's reserved peak is its own, not the previous, larger one's."""
    cut = env.cp_size * env.sp_size  # the GPUs a row is split over (CP, then sequence parallelism)
    rng = np.random.default_rng(0)
    points, floor, ratio = [], 0.0, 1.0
    saved_lr = [g["lr"] for g in optimizer.param_groups]
    had_state = bool(optimizer.state)
    try:
        for g in optimizer.param_groups:
            g["lr"] = 0.0
        small = [min(64, cfg.data.max_seq_length)]  # the warm-up step's window and each probe's lead
        warm, _ = _probe_data(small, cfg, env, rng)
        forward_backward(model, warm, env, loss_cfg=cfg.loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        # Made outside a metered step, so the CPU meter would not count the optimizer state that
        # every real step after the first holds (2 x the parameters for AdamW: 3.2 MiB on the
        # quickstart model, the bulk of a 7% under-prediction the adversarial run found).
        meter.track(resident_tensors(model, optimizer))
        for lengths in shapes or probe_shapes(cfg.data.max_seq_length):
            data, mb = _probe_data(lengths, cfg, env, rng, lead=small)
            if env.device.type == "cuda":
                torch.cuda.empty_cache()
            with meter.step():  # the run's own objective: the policy loss's entropy holds a softmax more
                forward_backward(model, data, env, loss_cfg=cfg.loss)
            if meter.peak_bytes and meter.reserved_bytes:
                ratio = max(ratio, meter.reserved_bytes / meter.peak_bytes)
            points.append((float(mb.cost), float(mb.area) / cut, float(meter.peak_bytes)))
            with meter.step():
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            floor = max(floor, float(meter.peak_bytes))
    finally:
        for g, lr in zip(optimizer.param_groups, saved_lr):
            g["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
    if not had_state:
        optimizer.state.clear()  # as before the probe: the first real step makes it
    return points, floor, ratio


# Bytes per token of a collated microbatch with every optional field (MicrobatchTensors: tokens,
# labels, position and segment ids int64; loss mask and weight, advantages, old / reference
# log-probabilities, sequence targets float32; valid bool): 4 x 8 + 6 x 4 + 1 = 57, rounded up.
INPUT_BYTES_PER_TOKEN = 64


def window_input_bytes(cfg, cp_size: int) -> int:
    """An upper bound on the collated input tensors a rank holds through a step: the whole window
    at the longest length (the quickstart: 32 x 1,024 tokens x 64 B = 2 MiB). The probe's own
    microbatch holds only its share, and the adversarial run measured the difference (0.5 MiB over
    the line on a window of 1,024-token rows)."""
    return cfg.train.global_batch_size * cfg.data.max_seq_length // cp_size * INPUT_BYTES_PER_TOKEN


def attention_materialised(backend: str) -> bool:
    """Whether the kernel holds a score matrix (its memory grows with the attention area)."""
    return backend == "sdpa"


def probe_memory(model, optimizer, cfg, env, *, backend: str, meter: MemoryMeter | None = None) -> ProbeResult:
    """Probe, fit and resolve the budget: every rank fits the worst rank's measurements under the
    smallest rank's limit, so all agree on the budget, or all stop with the same error."""
    start = time.perf_counter()
    meter = meter or MemoryMeter(env.device)
    with moe_stats.worst_case_routing(model):  # expert parallelism: one rank's experts get every token
        points, floor, ratio = run_probes(model, optimizer, cfg, env, meter)
    # Every rank fits the worst rank's measurements: one fit, one budget, one decision everywhere.
    worst = torch.tensor([p for _, _, p in points] + [floor, ratio], dtype=torch.float64, device=env.device)
    worst = dist_max_tensor(worst, env.group("world")).tolist()
    ratio = worst[-1]
    scaled = [(t, a, p * ratio) for (t, a, _), p in zip(points, worst)]
    fit = fit_memory(scaled, attention=attention_materialised(backend), floor=worst[-2] * ratio)
    # A step holds its whole window's collated inputs, a probe only its own microbatch's.
    inputs = window_input_bytes(cfg, env.cp_size)
    fit = dataclasses.replace(fit, a=fit.a + inputs, floor=fit.floor + inputs)
    limit = int(
        -dist_max(-_limit_bytes(cfg, meter), env.device, group=env.group("world"))
    )  # the smallest rank's: one decision everywhere
    margin = cfg.train.memory_margin
    cp = env.cp_size * env.sp_size  # a row's tokens per GPU after the CP and sequence-parallel cuts
    window_tokens = cfg.train.global_batch_size * cfg.data.max_seq_length // cp  # no microbatch holds more
    budget = resolve_budget(fit, limit, margin, cfg.data.max_seq_length, cp, ceiling=window_tokens)
    return ProbeResult(
        fit=fit,
        points=scaled,
        limit_bytes=limit,
        margin=margin,
        budget=budget,
        predicted_peak_bytes=worst_peak(fit, budget, cfg.data.max_seq_length, cp),
        fragmentation=ratio,
        seconds=time.perf_counter() - start,
    )
