"""Training-speed benchmark: fixed versus dynamic microbatching on the same windows, explained.

Arms (all on the same windows, alternating every step, one model): ``mbs1`` (fixed micro-batch
size 1), ``fixed_safe`` (the largest fixed size whose worst case, rows of the longest possible
sequence, fits the budget), ``sort_and_stride`` (the greedy baseline, padded), ``dynamic``
(this planner, padded rows) and ``dynamic_packed`` (this planner, packed rows). With
``compare_weight`` two more arms plan the dynamic layouts with attention weight 0 (tokens only).

Per arm: the measured step time, the modelled one, and the measured rank imbalance: per
microbatch slot the slowest rank's compute over the ranks' mean (compute = the process's CPU
time of the microbatch's forward and backward on CPU, where waiting in a collective costs none;
wall time on GPU), summed over slots: sum_j max_r t_rj / sum_j mean_r t_rj - 1.

The explanation is a cost model calibrated before the arms run, on microbatches of chosen shapes:
a microbatch of n rows padded to L costs c0 + c1 * n*L + c2 * n*L^2 seconds (launches and
data-parallel all-gathers; token-linear work; attention), plus t_step per step (the last
gradient sync, clipping, the optimizer). Packed rows are fitted separately (the per-sequence
kernels differ): a row of sequences l_i costs c0' + c1' * sum(l_i) + c2' * sum(l_i^2). Each arm's step time then splits into compute on real
tokens, compute on padding and per-microbatch overhead, and the predicted speedup is the ratio
of the predicted step times. The planner's own knobs are set from the fit: overhead c0 / c1
tokens, attention weight c2 / c1 (packed: c2' / c1') token-equivalents per token x length.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

from backend.batching import (
    DEFAULT_MICROBATCH_OVERHEAD,
    Microbatch,
    StepPlan,
    plan_dynamic,
    plan_fixed,
    plan_sort_and_stride,
    round_up,
)
from backend.data.collate import collate
from backend.data.iterator import StepData, collate_plan
from backend.data.jsonl import InMemoryDataset
from backend.data.sample import Sample
from backend.distributed.collectives import all_gather_objects, dist_max
from backend.distributed.fsdp import set_grad_sync
from backend.loss.cross_entropy import microbatch_loss_sum
from backend.train.step import train_step

from .length_sets import synthetic_lengths
from .memory import SavedActivationMeter

# Length sets: (synthetic generator, longest length, sequences per step, tokens per GPU).
CPU_SETS = {
    "short": ("short", 8192, 192, 4096),  # mean about 190 tokens, at most 512
    "rl_longtail": ("rl_longtail", 2048, 48, 8192),  # RL rollouts, 15% at the cap
    "embedded": ("embedded", 1024, 64, 8192),  # the embedded data set's real lengths
    "longtail4k": ("rl_longtail", 4096, 48, 8192),  # RL rollouts up to 4k: attention-aware pricing
}
GPU_SETS = {
    "short": ("short", 8192, 512, 16384),
    "rl_longtail": ("rl_longtail", 8192, 128, 16384),
    "embedded": ("embedded", 4096, 256, 16384),
}
ARMS = ("mbs1", "fixed_safe", "sort_and_stride", "dynamic", "dynamic_packed")
WEIGHT0_ARMS = ("dynamic_w0", "dynamic_packed_w0")


def _sync(env) -> None:
    if env.device.type == "cuda":
        torch.cuda.synchronize(env.device)
    dist.barrier(group=env.group("world"))


def _max_over_ranks(value: float, env) -> float:
    return dist_max(value, env.device, group=env.group("world"))


def _random_samples(lengths, rng) -> list[Sample]:
    return [Sample(tokens=rng.integers(0, 256, size=n)) for n in lengths]


def _fit(xs, ys) -> tuple[float, float, float]:
    # Relative least squares: a 1 ms microbatch must fit as well as a 1 s one, or the intercept
    # (the per-microbatch overhead that dynamic batching saves) is lost in the large shapes' noise.
    x, y = np.array(xs), np.array(ys)
    coef, *_ = np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)
    c0, c1, c2 = (max(0.0, float(c)) for c in coef)
    return c0, c1, c2


def _time_microbatch(model, mb, env, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):
        _sync(env)
        start = time.perf_counter()
        microbatch_loss_sum(model, mb, env).backward()
        _sync(env)
        times.append(_max_over_ranks(time.perf_counter() - start, env))
    return statistics.median(times[1:])


def calibrate(model, env, *, max_tokens: int, max_len: int, repeats: int = 3, seed: int = 0) -> dict:
    """Fit c0, c1, c2 from timed forward+backward of microbatches of chosen shapes (padded rows,
    then the same sequences as one packed row); t_step is measured separately."""
    rng = np.random.default_rng(seed)
    shapes = []
    length = 8
    while length <= max_len:
        for rows in (1, 2, 4, 8, 16, 32, 64, 128):
            if rows * length <= max_tokens:
                shapes.append((rows, length))
        length *= 2
    xs, ys, pys = [], [], []
    model.train()
    set_grad_sync(model, False)
    for rows, length in shapes:
        samples = _random_samples([length] * rows, rng)
        ids = tuple(range(rows))
        padded = collate(samples, list(ids), Microbatch(ids, length, rows * length, rows * length))
        packed = collate(samples, list(ids), Microbatch(ids, rows * length, rows * length, rows * length, packed=True))
        xs.append((1.0, rows * length, rows * length**2))
        ys.append(_time_microbatch(model, padded, env, repeats))
        pys.append(_time_microbatch(model, packed, env, repeats))
    model.zero_grad(set_to_none=True)
    c0, c1, c2 = _fit(xs, ys)
    p0, p1, p2 = _fit(xs, pys)
    return {
        "c0_s": c0,
        "c1_s_per_token": c1,
        "c2_s_per_token_len": c2,
        "packed_c0_s": p0,
        "packed_c1_s_per_token": p1,
        "packed_c2_s_per_token_len": p2,
        "shapes": len(shapes),
        "overhead_tokens": int(round(c0 / c1)) if c1 > 0 else DEFAULT_MICROBATCH_OVERHEAD,
        "attention_weight": c2 / c1 if c1 > 0 else 0.0,
        "packed_attention_weight": p2 / p1 if p1 > 0 else 0.0,
    }


def _mb_parts(mb: Microbatch, lengths: list[int], cal: dict) -> tuple[float, float, float]:
    """(real, padding, overhead) seconds of one microbatch under the calibrated model."""
    if not mb.indices:
        return 0.0, 0.0, cal["c0_s"]
    pre = "packed_" if mb.packed else ""
    c0, c1, c2 = cal[f"{pre}c0_s"], cal[f"{pre}c1_s_per_token"], cal[f"{pre}c2_s_per_token_len"]
    real_tokens = sum(lengths[i] for i in mb.indices)
    real_attn = sum(lengths[i] ** 2 for i in mb.indices)
    real = c1 * real_tokens + c2 * real_attn
    padded = c1 * mb.padded_tokens + c2 * mb.area
    return real, padded - real, c0


def breakdown(plan: StepPlan, lengths: list[int], cal: dict, t_step: float) -> dict:
    """Predicted step time split into real-token compute, padding compute and overhead.

    Ranks meet at every microbatch (FSDP all-gathers), so each slot lasts as long as its slowest rank.
    """
    real = pad = over = 0.0
    slot_max = slot_mean = 0.0
    for j in range(plan.num_microbatches):
        parts = [_mb_parts(rank[j], lengths, cal) for rank in plan.ranks]
        slowest = max(parts, key=sum)
        real, pad, over = real + slowest[0], pad + slowest[1], over + slowest[2]
        compute = [p[0] + p[1] for p in parts]
        slot_max, slot_mean = slot_max + max(compute), slot_mean + sum(compute) / len(compute)
    return {
        "real_compute_s": real,
        "padding_compute_s": pad,
        "overhead_s": over + t_step,
        "predicted_step_time_s": real + pad + over + t_step,
        "modelled_rank_imbalance": slot_max / slot_mean - 1.0 if slot_mean else 0.0,
    }


def make_arms(
    lengths: list[int], *, dp: int, cap: int, budget: int, cal: dict, compare_weight: bool = False
) -> dict[str, StepPlan]:
    safe = max(1, budget // round_up(cap, 1))
    overhead = cal["overhead_tokens"]
    common = dict(dp_size=dp, max_tokens_per_gpu=budget, overhead=overhead)
    arms = {
        "mbs1": plan_fixed(lengths, dp_size=dp, micro_batch_size=1),
        "fixed_safe": plan_fixed(lengths, dp_size=dp, micro_batch_size=safe),
        "sort_and_stride": plan_sort_and_stride(lengths, **common),
        "dynamic": plan_dynamic(lengths, attention_weight=cal["attention_weight"], **common),
        "dynamic_packed": plan_dynamic(
            lengths, layout="packed", attention_weight=cal["packed_attention_weight"], **common
        ),
    }
    if compare_weight:
        arms["dynamic_w0"] = plan_dynamic(lengths, **common)
        arms["dynamic_packed_w0"] = plan_dynamic(lengths, layout="packed", **common)
    return arms


def _imbalance(times: list[list[float]]) -> tuple[float, float]:
    """(sum over slots of the slowest rank's time, sum over slots of the ranks' mean time)."""
    slots = len(times[0])
    slot_max = sum(max(rank[j] for rank in times) for j in range(slots))
    slot_mean = sum(sum(rank[j] for rank in times) / len(times) for j in range(slots))
    return slot_max, slot_mean


def run_set(
    model,
    optimizer,
    scheduler,
    env,
    name: str,
    spec: tuple,
    cal: dict,
    *,
    steps: int,
    warmup: int,
    seed: int,
    compare_weight: bool = False,
) -> dict:
    generator, cap, gbs, budget = spec
    rng = np.random.default_rng(seed)
    windows = [synthetic_lengths(generator, gbs, seed=seed * 1000 + s, cap=cap) for s in range(warmup + steps)]
    cap = max(max(w) for w in windows)
    samples = _random_samples([n for w in windows for n in w], rng)
    dataset = InMemoryDataset(samples, source=name)
    # t_step: a one-row step minus that row's microbatch time (grad sync, clip, optimizer).
    arm_names = ARMS + (WEIGHT0_ARMS if compare_weight else ())
    records = {
        arm: {"time": [], "peak": [], "shapes": set(), "pred": [], "parts": [], "imb": [0.0, 0.0]} for arm in arm_names
    }
    clock = time.process_time if env.device.type == "cpu" else time.perf_counter
    offset = 0
    for step, lengths in enumerate(windows):
        ids = np.arange(offset, offset + len(lengths))
        offset += len(lengths)
        plans = make_arms(lengths, dp=env.dp_size, cap=cap, budget=budget, cal=cal, compare_weight=compare_weight)
        shift = step % len(arm_names)
        order = arm_names[shift:] + arm_names[:shift]  # alternate which arm goes first
        for arm in order:
            plan = plans[arm]
            data = StepData(
                ids,
                plan,
                collate_plan(dataset, ids, plan, dp_rank=env.dp_rank, cp_rank=0, cp_size=1),
                int(sum(n - 1 for n in lengths)),
            )
            meter = SavedActivationMeter() if env.device.type == "cpu" else None
            marks: list[float] = []

            @contextlib.contextmanager
            def hook(j, meter=meter, marks=marks):  # one microbatch's forward and backward
                start = clock()
                with meter.microbatch(j) if meter is not None else contextlib.nullcontext():
                    yield
                marks.append(clock() - start)

            _sync(env)
            if env.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(env.device)
            start = time.perf_counter()
            train_step(
                model,
                optimizer,
                scheduler,
                data,
                env,
                clip_grad=1.0,
                step=step,
                microbatch_hook=hook,
            )
            _sync(env)
            elapsed = _max_over_ranks(time.perf_counter() - start, env)
            peak = meter.peak if meter is not None else torch.cuda.max_memory_allocated(env.device)
            if step < warmup:
                continue
            r = records[arm]
            r["time"].append(elapsed)
            r["peak"].append(_max_over_ranks(float(peak), env))
            slot_max, slot_mean = _imbalance(all_gather_objects(marks, group=env.group("world")))
            r["imb"][0] += slot_max
            r["imb"][1] += slot_mean
            r["shapes"] |= {(mb.rows, mb.padded_len) for rank in plan.ranks for mb in rank if mb.indices}
            parts = breakdown(plan, lengths, cal, cal["t_step_s"])
            r["pred"].append(parts["predicted_step_time_s"])
            r["parts"].append(parts)
            r.setdefault("plans", []).append(plan)
    arms = {}
    for arm, r in records.items():
        plans = r["plans"]
        tokens = statistics.mean(p.tokens for p in plans)
        mean_parts = {k: statistics.mean(p[k] for p in r["parts"]) for k in r["parts"][0]}
        arms[arm] = {
            "median_step_time_s": statistics.median(r["time"]),
            "tokens_per_s": tokens / statistics.median(r["time"]),
            "padding_efficiency": sum(p.tokens for p in plans) / sum(p.padded_tokens for p in plans),
            "microbatches_per_step": statistics.mean(p.num_microbatches for p in plans),
            "peak_memory_bytes": int(max(r["peak"])),
            "distinct_shapes": len(r["shapes"]),
            **mean_parts,
            "measured_rank_imbalance": r["imb"][0] / r["imb"][1] - 1.0 if r["imb"][1] else 0.0,
            "modelled_rank_imbalance": mean_parts["modelled_rank_imbalance"],
            "speedup_vs_mbs1": _paired(records, "mbs1", arm),
            "predicted_speedup_vs_mbs1": arms_pred(records, "mbs1", arm),
        }
    paired = [a / b for a, b in zip(records["mbs1"]["time"], records["dynamic"]["time"])]
    return {
        "sequences_per_step": gbs,
        "max_tokens_per_gpu": budget,
        "longest": cap,
        "fixed_safe_mbs": max(1, budget // cap),
        "speedup_vs_mbs1": statistics.median(paired),
        "speedup_vs_fixed_safe": statistics.median(
            a / b for a, b in zip(records["fixed_safe"]["time"], records["dynamic"]["time"])
        ),
        "predicted_speedup": arms["mbs1"]["predicted_step_time_s"] / arms["dynamic"]["predicted_step_time_s"],
        "padding_efficiency": arms["dynamic"]["padding_efficiency"],
        "packed_padding_efficiency": arms["dynamic_packed"]["padding_efficiency"],
        "packed_vs_padded": _paired(records, "dynamic", "dynamic_packed"),
        "predicted_packed_vs_padded": arms_pred(records, "dynamic", "dynamic_packed"),
        "dynamic_vs_sort_and_stride": _paired(records, "sort_and_stride", "dynamic"),
        "packed_vs_sort_and_stride": _paired(records, "sort_and_stride", "dynamic_packed"),
        "predicted_dynamic_vs_sort_and_stride": arms_pred(records, "sort_and_stride", "dynamic"),
        "predicted_packed_vs_sort_and_stride": arms_pred(records, "sort_and_stride", "dynamic_packed"),
        "arms": arms,
    }


def _paired(records: dict, ref: str, arm: str) -> float:
    """Median over steps of ref's step time over arm's (paired on the same window)."""
    return statistics.median(a / b for a, b in zip(records[ref]["time"], records[arm]["time"]))


def arms_pred(records: dict, ref: str, arm: str) -> float:
    """The same ratio from the cost model's predicted step times."""
    return statistics.mean(records[ref]["pred"]) / statistics.mean(records[arm]["pred"])


def measure_t_step(model, optimizer, scheduler, env, cal: dict, repeats: int = 3) -> float:
    """Seconds a step spends outside its microbatches' forward/backward (last sync, clip, update)."""
    rng = np.random.default_rng(1)
    samples = _random_samples([16] * env.dp_size, rng)
    dataset = InMemoryDataset(samples, source="calibration")
    ids = np.arange(len(samples))
    plan = plan_fixed([16] * env.dp_size, dp_size=env.dp_size, micro_batch_size=1)
    times = []
    for step in range(repeats + 1):
        data = StepData(
            ids, plan, collate_plan(dataset, ids, plan, dp_rank=env.dp_rank, cp_rank=0, cp_size=1), 15 * env.dp_size
        )
        _sync(env)
        start = time.perf_counter()
        train_step(model, optimizer, scheduler, data, env, clip_grad=1.0, step=step)
        _sync(env)
        times.append(_max_over_ranks(time.perf_counter() - start, env))
    one_mb = cal["c0_s"] + cal["c1_s_per_token"] * 16 + cal["c2_s_per_token_len"] * 256
    return max(0.0, statistics.median(times[1:]) - one_mb)
