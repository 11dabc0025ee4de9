"""Memory follows the budget, not the longest microbatch a fixed plan draws; the benchmark and the
GPU check script run their CPU-side parts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

from .harness import run_ranks

pytestmark = pytest.mark.distributed


def peaks(rank: int, world: int):
    import functools

    import numpy as np

    from backend.batching import plan_dynamic, plan_fixed
    from backend.bench.memory import SavedActivationMeter
    from backend.config import load_config
    from backend.data.iterator import StepData, collate_plan
    from backend.data.jsonl import InMemoryDataset
    from backend.data.sample import Sample
    from backend.distributed.setup import init_distributed
    from backend.model.factory import build_model
    from backend.train.optim import build_optimizer, build_scheduler
    from backend.train.step import train_step

    env = init_distributed(1)
    cfg = load_config(None, ["model.hidden_size=64", "model.num_layers=2", "train.seed=0"])
    model = build_model(cfg, env, tokenizer_vocab=256).model
    opt = build_optimizer(model, cfg.optimizer)
    sched = build_scheduler(opt, cfg.optimizer, cfg.scheduler, 100)
    rng = np.random.default_rng(0)
    # 8,192 tokens a window: more than the largest budget, so each budget fills its microbatches.
    windows = {"short": [64] * 128, "one_long": [64] * 127 + [1024]}

    def peak(lengths, planner):
        ds = InMemoryDataset([Sample(tokens=rng.integers(0, 256, n)) for n in lengths], "mem")
        ids = np.arange(len(lengths))
        plan = planner(lengths)
        data = StepData(
            ids, plan, collate_plan(ds, ids, plan, dp_rank=0, cp_rank=0, cp_size=1), sum(n - 1 for n in lengths)
        )
        meter = SavedActivationMeter()
        train_step(model, opt, sched, data, env, clip_grad=1.0, step=0, microbatch_hook=meter.microbatch)
        return meter.peak

    fixed = functools.partial(plan_fixed, dp_size=1, micro_batch_size=4)
    out = {f"fixed_{w}": peak(lengths, fixed) for w, lengths in windows.items()}
    for budget in (256, 1024, 4096):
        dyn = functools.partial(plan_dynamic, dp_size=1, max_tokens_per_gpu=budget)
        for w, lengths in windows.items():
            out[f"dynamic{budget}_{w}"] = peak(lengths, dyn)
    return out


def test_peak_memory_follows_the_budget_not_the_longest_draw(tmp_path):
    p = run_ranks(peaks, 1, tmp_path)[0]
    # A fixed plan's peak jumps when a window happens to draw one long sequence into a microbatch ...
    assert p["fixed_one_long"] > 8 * p["fixed_short"]
    # ... a dynamic plan's peak is set by its budget: it grows with the budget ...
    assert p["dynamic256_short"] < p["dynamic1024_short"] < p["dynamic4096_short"]
    # ... and a long draw costs about what the budget allows: at 4096 tokens it changes nothing; at
    # 1024 the 1024-token row fills one microbatch by itself, and only its attention (quadratic in
    # length, which a token budget does not price) adds to the peak, far below the fixed plan's jump.
    assert p["dynamic4096_one_long"] <= 1.1 * p["dynamic4096_short"]
    assert p["dynamic1024_one_long"] <= 2.0 * p["dynamic1024_short"]
    assert p["dynamic1024_one_long"] < p["fixed_one_long"] / 3


def test_bench_train_quick_run_reports_every_key(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable,
        "tools/bench_train.py",
        "--sets",
        "short",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--scale",
        "0.1",
        "--out",
        str(out),
    ]
    proc = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    s = result["sets"]["short"]
    for key in ("speedup_vs_mbs1", "predicted_speedup", "padding_efficiency"):
        assert s[key] > 0
    assert set(s["arms"]) == {"mbs1", "fixed_safe", "sort_and_stride", "dynamic", "dynamic_packed"}
    assert s["packed_vs_padded"] > 0 and s["packed_padding_efficiency"] >= 0.99
    for arm in s["arms"].values():
        assert arm["measured_rank_imbalance"] >= 0 and arm["predicted_speedup_vs_mbs1"] > 0
        assert arm["real_compute_s"] >= 0 and arm["overhead_s"] > 0 and arm["peak_memory_bytes"] > 0
    assert "speedup vs mbs1: measured" in proc.stdout


def test_gpu_check_says_why_it_cannot_run_on_cpu(tmp_path):
    proc = subprocess.run(
        ["bash", "tools/env/gpu_check.sh", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHON=sys.executable),
        timeout=120,
    )
    assert proc.returncode == 3
    assert "no CUDA device visible" in proc.stdout and (tmp_path / "summary.txt").exists()


def probe_on_rank(rank: int, world: int) -> dict:
    from backend.batching.memory_fit import resolve_budget
    from backend.config import load_config, validate
    from backend.distributed.setup import init_distributed
    from backend.model.factory import build_model
    from backend.train.memory_meter import MemoryMeter, resident_tensors
    from backend.train.memory_probe import probe_memory
    from backend.train.optim import build_optimizer

    env = init_distributed(1)
    limit = 0.03 if rank == 0 else 0.06  # GiB: ranks with different memory; the budget is the smaller one
    overrides = ["train.dynamic_batch_enable=true", "train.max_tokens_per_gpu=auto", f"train.memory_limit_gib={limit}"]
    cfg = validate(load_config(str(REPO / "tests" / "configs" / "tiny.yaml"), overrides), world)
    built = build_model(cfg, env, tokenizer_vocab=256)
    opt = build_optimizer(built.model, cfg.optimizer)
    meter = MemoryMeter(env.device, resident_tensors(built.model, opt))
    result = probe_memory(built.model, opt, cfg, env, backend=built.attention_backend, meter=meter)
    ceiling = cfg.train.global_batch_size * cfg.data.max_seq_length
    own = resolve_budget(result.fit, limit * 2**30, result.margin, cfg.data.max_seq_length, ceiling=ceiling)
    return {"budget": result.budget, "own": own, "a": result.fit.a}


def test_ranks_agree_on_the_smallest_budget(tmp_path):
    r0, r1 = run_ranks(probe_on_rank, 2, tmp_path)
    assert r0["own"] < r1["own"]  # rank 0 alone would choose less
    assert r0["budget"] == r1["budget"] == r0["own"] and r0["a"] == r1["a"]  # one fit, the smaller limit
