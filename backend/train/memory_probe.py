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

from backend.batching import PlanArgs, make_planner
from backend.batching.memory_fit import MemoryFit, fit_memory, resolve_budget, worst_peak
from backend.data.iterator import StepData, collate_plan
from backend.data.jsonl import InMemoryDataset
from backend.data.sample import Sample
from backend.distributed.collectives import dist_max

from .memory_meter import MemoryMeter
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
            f"{self.fit.b / 1024:,.2f} KiB x tokens + {self.fit.c:,.1f} B x attention pairs "
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


def run_probes(model, optimizer, cfg, env, meter: MemoryMeter, shapes: list[list[int]] | None = None):
    """(points, fragmentation): each probe shape's (tokens, area, peak bytes) on this rank."""
    cp = env.cp_size
    rng = np.random.default_rng(0)
    points, ratio = [], 1.0
    saved_lr = [g["lr"] for g in optimizer.param_groups]
    had_state = bool(optimizer.state)
    for lengths in shapes or probe_shapes(cfg.data.max_seq_length):
        samples = [Sample(tokens=rng.integers(0, 256, size=n).astype(np.int64)) for n in lengths]  # any vocabulary
        dataset = InMemoryDataset(samples, source="memory probe")
        args = PlanArgs(
            dp_size=1,
            cp_size=cp,
            max_tokens_per_gpu=2 * len(lengths) * max(lengths),  # everything in one microbatch, padded or packed
            pad_to_multiple=cfg.train.dynamic_batch_pad_to_multiple,
            layout=cfg.train.dynamic_batch_layout,
        )
        one_rank = make_planner("dynamic", args)(list(lengths))
        if len(one_rank.ranks[0]) != 1:
            raise RuntimeError(f"memory probe: the window {lengths} did not plan as one microbatch")
        plan = dataclasses.replace(one_rank, ranks=one_rank.ranks * env.dp_size)  # every rank: the same shape
        ids = np.arange(len(samples))
        batches = collate_plan(dataset, ids, plan, dp_rank=0, cp_rank=env.cp_rank, cp_size=cp)
        data = StepData(ids, plan, batches, int(dataset.loss_token_counts.sum()) * env.dp_size, len(samples))
        mb = plan.ranks[0][0]
        for g in optimizer.param_groups:
            g["lr"] = 0.0
        try:
            with meter.step():
                forward_backward(model, data, env, loss_cfg=None)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        finally:
            for g, lr in zip(optimizer.param_groups, saved_lr):
                g["lr"] = lr
        if meter.peak_bytes and meter.reserved_bytes:
            ratio = max(ratio, meter.reserved_bytes / meter.peak_bytes)
        points.append((float(mb.cost), float(mb.area) / cp, float(meter.peak_bytes)))
    if not had_state:
        optimizer.state.clear()  # as before the probe: the first real step makes it
    return points, ratio


def attention_materialised(backend: str, device_type: str) -> bool:
    """Whether the kernel holds a score matrix (its memory grows with the attention area)."""
    return backend == "sdpa"


def probe_memory(model, optimizer, cfg, env, *, backend: str, meter: MemoryMeter | None = None) -> ProbeResult:
    """Probe, fit and resolve the budget (the minimum over ranks)."""
    start = time.perf_counter()
    meter = meter or MemoryMeter(env.device)
    points, ratio = run_probes(model, optimizer, cfg, env, meter)
    ratio = float(dist_max(ratio, env.device))
    scaled = [(t, a, p * ratio) for t, a, p in points]
    fit = fit_memory(scaled, attention=attention_materialised(backend, env.device.type))
    limit = _limit_bytes(cfg, meter)
    margin = cfg.train.memory_margin
    cp = env.cp_size
    budget = resolve_budget(fit, limit, margin, cfg.data.max_seq_length, cp)
    budget = int(-dist_max(-budget, env.device))  # the minimum over ranks
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
