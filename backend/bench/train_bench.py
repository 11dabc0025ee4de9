"""Training-speed benchmark: fixed versus dynamic microbatching on the same windows, explained.

Arms (all on the same windows, alternating every step, one model): ``mbs1`` (fixed micro-batch
size 1), ``fixed_safe`` (the largest fixed size whose worst case, rows of the longest possible
sequence, fits the budget) and ``dynamic``.

The explanation is a cost model calibrated before the arms run, on microbatches of chosen shapes:
a microbatch of n rows padded to L costs c0 + c1 * n*L + c2 * n*L^2 seconds (launches and
data-parallel all-gathers; token-linear work; attention), plus t_step per step (the last
gradient sync, clipping, the optimizer). Each arm's step time then splits into compute on real
tokens, compute on padding and per-microbatch overhead, and the predicted speedup is the ratio
of the predicted step times. The planner's own overhead knob is set to c0 / c1 tokens.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

from backend.batching import DEFAULT_MICROBATCH_OVERHEAD, Microbatch, StepPlan, plan_dynamic, plan_fixed, round_up
from backend.data.collate import collate
from backend.data.iterator import StepData, collate_plan
from backend.data.jsonl import InMemoryDataset
from backend.data.sample import Sample
from backend.distributed.collectives import dist_max
from backend.distributed.fsdp import set_grad_sync
from backend.train.step import microbatch_loss_sum, train_step

from .length_sets import synthetic_lengths
from .memory import SavedActivationMeter

# Length sets: (synthetic generator, longest length, sequences per step, tokens per GPU).
CPU_SETS = {
    "short": ("short", 8192, 192, 4096),  # mean about 190 tokens, at most 512
    "rl_longtail": ("rl_longtail", 2048, 48, 8192),  # RL rollouts, 15% at the cap
    "embedded": ("embedded", 1024, 64, 8192),  # the embedded data set's real lengths
}
GPU_SETS = {
    "short": ("short", 8192, 512, 16384),
    "rl_longtail": ("rl_longtail", 8192, 128, 16384),
    "embedded": ("embedded", 4096, 256, 16384),
}
ARMS = ("mbs1", "fixed_safe", "dynamic")


def _sync(env) -> None:
    if env.device.type == "cuda":
        torch.cuda.synchronize(env.device)
    dist.barrier()


def _max_over_ranks(value: float, env) -> float:
    return dist_max(value, env.device)


def _random_samples(lengths, rng) -> list[Sample]:
    return [Sample(tokens=rng.integers(0, 256, size=n)) for n in lengths]


def calibrate(model, env, *, max_tokens: int, max_len: int, repeats: int = 3, seed: int = 0) -> dict:
    """Fit c0, c1, c2 from timed forward+backward of microbatches of chosen shapes; time t_step."""
    rng = np.random.default_rng(seed)
    shapes = []
    length = 8
    while length <= max_len:
        for rows in (1, 2, 4, 8, 16, 32, 64, 128):
            if rows * length <= max_tokens:
                shapes.append((rows, length))
        length *= 2
    xs, ys = [], []
    model.train()
    set_grad_sync(model, False)
    for rows, length in shapes:
        samples = _random_samples([length] * rows, rng)
        mb = collate(samples, list(range(rows)), Microbatch(tuple(range(rows)), length, rows * length, rows * length))
        times = []
        for _ in range(repeats + 1):
            _sync(env)
            start = time.perf_counter()
            microbatch_loss_sum(model, mb, env).backward()
            _sync(env)
            times.append(_max_over_ranks(time.perf_counter() - start, env))
        xs.append((1.0, rows * length, rows * length**2))
        ys.append(statistics.median(times[1:]))
    model.zero_grad(set_to_none=True)
    # Relative least squares: a 1 ms microbatch must fit as well as a 1 s one, or the intercept
    # (the per-microbatch overhead that dynamic batching saves) is lost in the large shapes' noise.
    x, y = np.array(xs), np.array(ys)
    coef, *_ = np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)
    c0, c1, c2 = (max(0.0, float(c)) for c in coef)
    return {
        "c0_s": c0,
        "c1_s_per_token": c1,
        "c2_s_per_token_len": c2,
        "shapes": len(shapes),
        "overhead_tokens": int(round(c0 / c1)) if c1 > 0 else DEFAULT_MICROBATCH_OVERHEAD,
    }


def _mb_parts(mb: Microbatch, lengths: list[int], cal: dict) -> tuple[float, float, float]:
    """(real, padding, overhead) seconds of one microbatch under the calibrated model."""
    if not mb.indices:
        return 0.0, 0.0, cal["c0_s"]
    c1, c2 = cal["c1_s_per_token"], cal["c2_s_per_token_len"]
    n, L = len(mb.indices), mb.padded_len
    real_tokens = sum(lengths[i] for i in mb.indices)
    real_attn = sum(lengths[i] ** 2 for i in mb.indices)
    real = c1 * real_tokens + c2 * real_attn
    padded = c1 * n * L + c2 * n * L * L
    return real, padded - real, cal["c0_s"]


def breakdown(plan: StepPlan, lengths: list[int], cal: dict, t_step: float) -> dict:
    """Predicted step time split into real-token compute, padding compute and overhead.

    Ranks meet at every microbatch (FSDP all-gathers), so each slot lasts as long as its slowest rank.
    """
    real = pad = over = 0.0
    for j in range(plan.num_microbatches):
        parts = [_mb_parts(rank[j], lengths, cal) for rank in plan.ranks]
        slowest = max(parts, key=sum)
        real, pad, over = real + slowest[0], pad + slowest[1], over + slowest[2]
    return {
        "real_compute_s": real,
        "padding_compute_s": pad,
        "overhead_s": over + t_step,
        "predicted_step_time_s": real + pad + over + t_step,
    }


def make_arms(lengths: list[int], *, dp: int, cap: int, budget: int, overhead: int) -> dict[str, StepPlan]:
    safe = max(1, budget // round_up(cap, 1))
    return {
        "mbs1": plan_fixed(lengths, dp_size=dp, micro_batch_size=1),
        "fixed_safe": plan_fixed(lengths, dp_size=dp, micro_batch_size=safe),
        "dynamic": plan_dynamic(lengths, dp_size=dp, max_tokens_per_gpu=budget, overhead=overhead),
    }


def run_set(
    model, optimizer, scheduler, env, name: str, spec: tuple, cal: dict, *, steps: int, warmup: int, seed: int
) -> dict:
    generator, cap, gbs, budget = spec
    rng = np.random.default_rng(seed)
    windows = [synthetic_lengths(generator, gbs, seed=seed * 1000 + s, cap=cap) for s in range(warmup + steps)]
    cap = max(max(w) for w in windows)
    samples = _random_samples([n for w in windows for n in w], rng)
    dataset = InMemoryDataset(samples, source=name)
    # t_step: a one-row step minus that row's microbatch time (grad sync, clip, optimizer).
    records = {arm: {"time": [], "peak": [], "shapes": set(), "pred": [], "parts": []} for arm in ARMS}
    offset = 0
    for step, lengths in enumerate(windows):
        ids = np.arange(offset, offset + len(lengths))
        offset += len(lengths)
        plans = make_arms(lengths, dp=env.dp_size, cap=cap, budget=budget, overhead=cal["overhead_tokens"])
        order = ARMS[step % 3 :] + ARMS[: step % 3]  # alternate which arm goes first
        for arm in order:
            plan = plans[arm]
            data = StepData(
                ids,
                plan,
                collate_plan(dataset, ids, plan, dp_rank=env.dp_rank, cp_rank=0, cp_size=1),
                int(sum(n - 1 for n in lengths)),
            )
            meter = SavedActivationMeter() if env.device.type == "cpu" else None
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
                microbatch_hook=meter.microbatch if meter is not None else None,
            )
            _sync(env)
            elapsed = _max_over_ranks(time.perf_counter() - start, env)
            peak = meter.peak if meter is not None else torch.cuda.max_memory_allocated(env.device)
            if step < warmup:
                continue
            r = records[arm]
            r["time"].append(elapsed)
            r["peak"].append(_max_over_ranks(float(peak), env))
            r["shapes"] |= {(len(mb.indices), mb.padded_len) for rank in plan.ranks for mb in rank if mb.indices}
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
        "arms": arms,
    }


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
