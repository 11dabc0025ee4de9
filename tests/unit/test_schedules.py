"""Learning-rate schedules (backend.train.optim): each type's curve, resume, and config errors."""

from __future__ import annotations

import math

import pytest
import torch

from backend.config import ConfigError, load_config, validate
from backend.config.schema import OptimizerConfig, SchedulerConfig
from backend.train.optim import build_scheduler, lr_at

LR, MIN = 1.0, 0.1


def curve(total: int, **sched) -> list[float]:
    """The lr of optimizer steps 1..total, read from a real LambdaLR stepped like the trainer does."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    sch = build_scheduler(opt, OptimizerConfig(lr=LR, min_lr=MIN), SchedulerConfig(**sched), total)
    out = []
    for _ in range(total):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sch.step()
    return out


def test_cosine_is_the_default_and_unchanged():
    """The formula before schedule types existed: linear warm-up, then cosine to min_lr."""

    def before(step, warmup, total):
        if warmup and step < warmup:
            return LR * (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return MIN + (LR - MIN) * 0.5 * (1.0 + math.cos(math.pi * progress))

    assert SchedulerConfig().type == "cosine"
    for warmup, total in ((0, 10), (3, 20), (2, 2), (5, 3)):
        got = curve(total, warmup_iters=warmup)
        assert got == pytest.approx([before(s, warmup, total) for s in range(total)], abs=1e-12)


def test_warmup_is_linear_for_every_type():
    for kind in ("cosine", "linear", "constant", "wsd"):
        got = curve(20, type=kind, warmup_iters=4)
        assert got[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0]), kind


def test_linear_decays_in_equal_steps_to_min_lr_at_train_iters():
    got = curve(12, type="linear", warmup_iters=2)
    # after warm-up: lr - (lr - min_lr) * (step - warmup) / (total - warmup), steps 2..11
    assert got[2:] == pytest.approx([LR - (LR - MIN) * k / 10 for k in range(10)])
    assert lr_at(12, lr=LR, min_lr=MIN, warmup=2, total=12, kind="linear") == pytest.approx(MIN)
    assert lr_at(50, lr=LR, min_lr=MIN, warmup=2, total=12, kind="linear") == pytest.approx(MIN)  # held after


def test_constant_holds_lr_after_warmup():
    assert curve(10, type="constant", warmup_iters=3)[3:] == [LR] * 7


@pytest.mark.parametrize(
    "style, shape",
    [
        ("linear", lambda p: 1 - p),
        ("cosine", lambda p: 0.5 * (1 + math.cos(math.pi * p))),
        ("sqrt", lambda p: 1 - math.sqrt(p)),
    ],
)
def test_wsd_is_stable_then_decays_over_the_last_fraction(style, shape):
    total, warmup = 100, 5
    got = curve(total, type="wsd", warmup_iters=warmup, decay_fraction=0.2, decay_style=style)
    assert got[warmup:80] == [LR] * 75  # stable until the last ceil(0.2 * 100) = 20 steps
    expected = [MIN + (LR - MIN) * shape(k / 20) for k in range(20)]
    assert got[80:] == pytest.approx(expected)
    assert all(a >= b for a, b in zip(got[80:], got[81:]))  # decays monotonically
    end = lr_at(total, lr=LR, min_lr=MIN, warmup=warmup, total=total, kind="wsd", decay_fraction=0.2, decay_style=style)
    assert end == pytest.approx(MIN)


def test_wsd_decay_length_rounds_up():
    got = curve(10, type="wsd", warmup_iters=0, decay_fraction=0.25)  # ceil(2.5) = 3 decay steps
    assert got[:7] == [LR] * 7 and got[7] == LR and got[8] < LR and got[9] < got[8]


def test_scheduler_state_resumes_on_the_same_curve():
    total = 30
    sched = dict(type="wsd", warmup_iters=3, decay_fraction=0.3, decay_style="sqrt")
    full = curve(total, **sched)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    first = build_scheduler(opt, OptimizerConfig(lr=LR, min_lr=MIN), SchedulerConfig(**sched), total)
    for _ in range(17):
        opt.step()
        first.step()
    state = first.state_dict()
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    second = build_scheduler(opt2, OptimizerConfig(lr=LR, min_lr=MIN), SchedulerConfig(**sched), total)
    second.load_state_dict(state)
    resumed = []
    for _ in range(17, total):
        resumed.append(second.get_last_lr()[0])
        opt2.step()
        second.step()
    assert resumed == pytest.approx(full[17:])


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["scheduler.type=step"], "scheduler.type='step': allowed values are cosine, linear, constant, wsd"),
        (["scheduler.decay_style=exp"], "scheduler.decay_style='exp': allowed values are linear, cosine, sqrt"),
        (["scheduler.decay_fraction=0"], "scheduler.decay_fraction=0.0: must be in (0, 1]"),
        (["scheduler.decay_fraction=1.5"], "scheduler.decay_fraction=1.5: must be in (0, 1]"),
        (["scheduler.warmup_iters=-1"], "scheduler.warmup_iters=-1: must be >= 0"),
        (
            ["scheduler.type=wsd", "scheduler.warmup_iters=8", "scheduler.decay_fraction=0.3", "train.train_iters=10"],
            "scheduler.warmup_iters=8: warm-up plus the wsd decay phase",
        ),
    ],
)
def test_config_errors_name_the_key(overrides, needle):
    with pytest.raises(ConfigError) as err:
        validate(load_config(None, overrides))
    assert needle in str(err.value)


def test_valid_schedule_configs_pass():
    for overrides in (
        ["scheduler.type=linear"],
        ["scheduler.type=constant", "scheduler.warmup_iters=0"],
        ["scheduler.type=wsd", "scheduler.decay_style=cosine", "scheduler.decay_fraction=0.5", "train.train_iters=10"],
    ):
        validate(load_config(None, overrides))
