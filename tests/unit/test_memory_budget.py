"""train.max_tokens_per_gpu=auto: the fit, the budget it resolves, the meter and the probe.

The fit and the budget are pure arithmetic (``backend.batching.memory_fit``): a fake meter with
known a, b, c is fitted back and gives the exact budget; no microbatch any planner forms under the
budget is predicted over the limit. On the tiny model with SDPA the probe's budget holds: held-out
microbatch shapes at that budget measure at or under the prediction.
"""

from __future__ import annotations

import contextlib
import json
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backend.batching import PlanArgs, make_planner
from backend.batching.memory_fit import BUDGET_QUANTUM, BudgetError, MemoryFit, fit_memory, resolve_budget, worst_peak
from backend.config import load_config, validate
from backend.model.factory import build_model
from backend.train.memory_meter import MemoryMeter, resident_tensors
from backend.train.memory_probe import probe_memory, run_probes
from backend.train.optim import build_optimizer
from tests.conftest import TINY

TRUE = MemoryFit(a=3.0e8, b=2.5e4, c=6.0)  # 286 MiB, 24.4 KiB a token, 6 B a score


def fake_points(fit: MemoryFit, shapes) -> list[tuple[float, float, float]]:
    return [(t, a, fit.predict(t, a)) for t, a in shapes]


def test_a_fake_meter_is_fitted_back_exactly():
    shapes = [(4096, 4096**2), (8192, 2 * 4096**2), (8192, 8192 * 256), (6144, 3 * 1024**2)]
    fit = fit_memory(fake_points(TRUE, shapes))
    assert fit.a == pytest.approx(TRUE.a, rel=1e-9) and fit.b == pytest.approx(TRUE.b, rel=1e-9)
    assert fit.c == pytest.approx(TRUE.c, rel=1e-9)
    flat = fit_memory(fake_points(MemoryFit(3.0e8, 2.5e4, 0.0), shapes), attention=False)
    assert flat.c == 0 and flat.b == pytest.approx(2.5e4)


def test_probes_above_the_line_raise_it():
    shapes = [(1024, 1024**2), (2048, 2 * 1024**2), (2048, 2048 * 64), (1536, 3 * 512**2)]
    points = fake_points(TRUE, shapes)
    points[2] = (points[2][0], points[2][1], points[2][2] + 5e6)  # one probe 5 MB over the others' line
    fit = fit_memory(points)
    assert all(fit.predict(t, a) >= p - 1e-3 for t, a, p in points)


def test_the_budget_is_the_largest_that_fits():
    limit, margin, max_len = 8 * 2**30, 0.1, 4096
    budget = resolve_budget(TRUE, limit, margin, max_len)
    usable = limit * (1 - margin)
    assert budget % BUDGET_QUANTUM == 0
    assert worst_peak(TRUE, budget, max_len) <= usable < worst_peak(TRUE, budget + BUDGET_QUANTUM, max_len)
    # By brute force over every multiple of 64.
    fits = [b for b in range(64, 1 << 20, 64) if worst_peak(TRUE, b, max_len) <= usable]
    assert budget == fits[-1]
    # Doubling the memory raises the budget by what the model says: (usable gained) / marginal bytes.
    doubled = resolve_budget(TRUE, 2 * limit, margin, max_len)
    marginal = TRUE.b + TRUE.c * max_len  # bytes per token once rows are at the longest length
    assert doubled - budget == pytest.approx(usable / marginal, rel=0.01, abs=64)


def test_a_sequence_that_cannot_fit_alone_names_what_to_change():
    with pytest.raises(BudgetError, match=r"data.max_seq_length=65536 does not fit: .* GiB, over the .* GiB") as err:
        resolve_budget(TRUE, 16 * 2**30, 0.1, 65536)
    for key in ("model.recompute_granularity", "parallel.context_parallel_size", "train.memory_limit_gib"):
        assert key in str(err.value)
    assert resolve_budget(TRUE, 16 * 2**30, 0.1, 65536, cp_size=4) > 0  # CP splits the singleton


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 4096), min_size=1, max_size=64),
    gib=st.floats(2.0, 64.0),
    cp=st.sampled_from([1, 2, 4]),
    layout=st.sampled_from(["padded", "packed"]),
)
def test_no_planned_microbatch_is_predicted_over_the_limit(lengths, gib, cp, layout):
    limit, margin, max_len = gib * 2**30, 0.1, 4096
    try:
        budget = resolve_budget(TRUE, limit, margin, max_len, cp)
    except BudgetError:
        return
    plan = make_planner("dynamic", PlanArgs(dp_size=2, cp_size=cp, max_tokens_per_gpu=budget, layout=layout))(lengths)
    for rank in plan.ranks:
        for mb in rank:
            assert TRUE.predict(mb.cost, mb.area / cp) <= limit * (1 - margin) + 1e-6


def build_tiny(world, recompute: str = "none", extra: tuple = ()):
    cfg = validate(
        load_config(
            TINY,
            [
                "train.dynamic_batch_enable=true",
                "train.max_tokens_per_gpu=auto",
                "train.memory_limit_gib=0.5",
                "data.max_seq_length=256",
                f"model.recompute_granularity={recompute}",
                *extra,
            ],
        ),
        from_memory=bool(extra),  # a policy loss: rows come from memory (data.path holds none)
    )
    built = build_model(cfg, world, tokenizer_vocab=256)
    optimizer = build_optimizer(built.model, cfg.optimizer)
    return cfg, built, optimizer


@pytest.fixture(scope="module")
def tiny(world):
    return build_tiny(world)


@pytest.fixture(scope="module")
def probed(world, tiny):
    """The probe's result on the tiny model without recomputation (shared: it takes ~1 s)."""
    cfg, built, optimizer = tiny
    meter = MemoryMeter(world.device, resident_tensors(built.model, optimizer))
    return probe_memory(built.model, optimizer, cfg, world, backend=built.attention_backend, meter=meter)


@pytest.fixture(scope="module")
def probed_dense(world):
    """The probe's result on the tiny model with the dense-mask SDPA path pinned (its score
    matrices are what selective recomputation drops)."""
    with _dense_mask_path():
        cfg, built, optimizer = build_tiny(world)
        meter = MemoryMeter(world.device, resident_tensors(built.model, optimizer))
        return probe_memory(built.model, optimizer, cfg, world, backend=built.attention_backend, meter=meter)


@contextlib.contextmanager
def _dense_mask_path():
    from backend.model.attention import sdpa

    old, sdpa.CAUSAL_FAST_PATHS = sdpa.CAUSAL_FAST_PATHS, False
    try:
        yield
    finally:
        sdpa.CAUSAL_FAST_PATHS = old


HELD_OUT = [[256] * 3, [200, 120, 90, 60], [40] * 12, [256, 16, 16]]  # microbatches a planner could form


def test_the_probe_budget_holds_on_held_out_shapes(world, tiny):
    cfg, built, optimizer = tiny
    before = [p.detach().clone() for p in built.model.parameters()]
    meter = MemoryMeter(world.device, resident_tensors(built.model, optimizer))
    result = probe_memory(built.model, optimizer, cfg, world, backend=built.attention_backend, meter=meter)
    # the causal kernel (padded rows without CP) keeps no score matrix: nothing grows with length^2
    assert result.budget % 64 == 0 and result.fit.b > 0 and result.fit.c >= 0
    assert result.predicted_peak_bytes <= 0.5 * 2**30 * 0.9
    # The probe leaves weights exactly as they were and the optimizer without state.
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, built.model.parameters())) and not optimizer.state
    points, floor, _ = run_probes(built.model, optimizer, cfg, world, meter, shapes=HELD_OUT)
    for tokens, area, peak in points:
        assert peak <= result.fit.predict(tokens, area), (tokens, area, peak)
    assert 0 < floor <= result.fit.floor * 1.05  # the optimizer step's own peak, as probed


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recomputation_lowers_the_fit_and_its_budget_holds(world, probed, probed_dense, recompute):
    """selective drops the score matrix the dense-mask SDPA path keeps (CP, windows, sinks; c: 8.0
    -> 1.0 B a pair on the tiny model; the causal kernel keeps none: c = 0); full keeps only each
    layer's input (b: 16.2 -> 8.9 KiB a token). Either way the probe's budget still holds on
    held-out shapes."""
    base = probed_dense if recompute == "selective" else probed
    with _dense_mask_path() if recompute == "selective" else contextlib.nullcontext():
        cfg, built, optimizer = build_tiny(world, recompute)
        meter = MemoryMeter(world.device, resident_tensors(built.model, optimizer))
        result = probe_memory(built.model, optimizer, cfg, world, backend=built.attention_backend, meter=meter)
        points, _, _ = run_probes(built.model, optimizer, cfg, world, meter, shapes=HELD_OUT)
    if recompute == "selective":
        assert probed_dense.fit.c > 0 and probed.fit.c < 0.25 * probed_dense.fit.c  # the causal kernel's saving
        assert result.fit.c < 0.25 * base.fit.c and result.fit.b <= base.fit.b * 1.02
    else:
        assert result.fit.b < 0.75 * base.fit.b
    assert result.predicted_peak_bytes < base.predicted_peak_bytes
    for tokens, area, peak in points:
        assert peak <= result.fit.predict(tokens, area), (tokens, area, peak)


def test_the_cpu_meter_counts_a_step_not_the_process(world, tiny):
    cfg, built, optimizer = tiny
    meter = MemoryMeter(world.device, resident_tensors(built.model, optimizer))
    with meter.step():
        x = torch.zeros(1 << 20)  # 4 MiB, freed before the step ends
        del x
    first = meter.peak_bytes
    with meter.step():
        pass
    assert first - meter.peak_bytes == 4 << 20  # this step's peak, not the lifetime's
    weights = sum(p.numel() * p.element_size() for p in built.model.parameters())
    assert meter.peak_bytes >= weights
    assert np.isfinite(meter.peak_bytes)


def test_a_step_over_its_prediction_warns_and_lowers_the_budget(world, tmp_path, caplog):
    import logging

    from backend.train.trainer import Trainer

    cfg = validate(
        load_config(
            TINY,
            [
                "train.dynamic_batch_enable=true",
                "train.max_tokens_per_gpu=auto",
                "train.memory_limit_gib=0.25",
                "data.max_seq_length=256",
                "train.train_iters=2",
                f"logger.run_dir={tmp_path / 'run'}",
                f"checkpoint.dir={tmp_path / 'ckpt'}",
                "checkpoint.resume=false",
                "checkpoint.interval=0",
                "logger.log_interval=1000",
            ],
        )
    )
    trainer = Trainer(cfg, world)
    budget = trainer.cfg.train.max_tokens_per_gpu
    assert isinstance(budget, int) and budget % 64 == 0 and trainer.cfg.train.forward_max_tokens_per_gpu == budget
    fit = trainer.memory.fit
    trainer.memory.fit = MemoryFit(fit.a / 4, fit.b / 4, fit.c / 4)  # a fit that under-predicts 4x
    with caplog.at_level(logging.WARNING, logger="backend.train.engine"):
        trainer.train()
    trainer.metrics.close()
    warning = next(r.getMessage() for r in caplog.records if "over the probe's prediction" in r.getMessage())
    first = int(re.search(rf"train.max_tokens_per_gpu {budget} -> (\d+)", warning).group(1))
    lowered = trainer.cfg.train.max_tokens_per_gpu
    assert lowered <= first < budget and first % 64 == 0  # lowered, never raised
    assert trainer.windows.planner.keywords["args"].max_tokens_per_gpu == lowered  # the windows planned next


def test_adversarial_windows_stay_under_the_prediction(world, tmp_path):
    """The CPU mirror of gpu_check's adversarial run (tools/bench/memory_adversary.py): windows of only
    maximum-length rows, one maximum-length row among short ones, only short rows, each trained at
    the budget auto resolves under a limit small enough that the window cap does not bind."""
    from backend.bench.memory_adversary import PHASES, run_phase

    for kind in PHASES:
        phase = run_phase(TINY, ["train.memory_limit_gib=0.05"], kind, 2, tmp_path, world)
        assert phase["within_prediction"], phase
        assert phase["tight"], phase  # 1.15x the budget would be predicted over the limit
        assert phase["final_budget"] == phase["budget"] < 16 * 256  # not lowered; under the window cap
        assert all(s["peak_memory_bytes"] <= 0.05 * 2**30 * 0.9 for s in phase["steps"])
        assert not any((tmp_path / kind / "checkpoints").glob("step_*"))  # a benchmark writes no checkpoint
    rows = [json.loads(line) for line in (tmp_path / "singleton.jsonl").read_text().splitlines()]
    assert len(rows) == 16 and sorted(len(r["input_ids"]) for r in rows)[-2:][0] <= 64  # one long row per window


def test_the_probe_prices_the_runs_own_objective(world, probed):
    """The probe runs the configured objective: the policy loss measures its entropy's softmax
    beside the logits (more bytes a token than cross-entropy), and its budget holds on held-out
    shapes under that objective. Probed with cross-entropy instead, an unchunked policy run on a
    151,936-token vocabulary measured steps 45% over the prediction."""
    policy = ("loss.type=policy", "loss.entropy_coef=0.01", "loss.old_logprobs=detach")
    cfg, built, optimizer = build_tiny(world, extra=policy)
    meter = MemoryMeter(world.device, resident_tensors(built.model, optimizer))
    result = probe_memory(built.model, optimizer, cfg, world, backend=built.attention_backend, meter=meter)
    assert result.fit.b > probed.fit.b  # the softmax the entropy holds
    points, _, _ = run_probes(built.model, optimizer, cfg, world, meter, shapes=HELD_OUT)
    for tokens, area, peak in points:
        assert peak <= result.fit.predict(tokens, area), (tokens, area, peak)
