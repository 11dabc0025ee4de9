"""Console: the progress display (piped: one line per step; terminal: redrawn in place), eval rows, summaries."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap
from pathlib import Path

from backend.logging.console import (
    ProgressDisplay,
    format_duration,
    format_end_summary,
    format_startup_summary,
    length_stats,
    run_totals,
)
from backend.logging.metrics import MetricsLogger, read_metrics

REPO = Path(__file__).resolve().parents[2]


def step_row(step: int, **extra) -> dict:
    return {
        "step": step,
        "loss": 4.0 / step,
        "grad_norm": 1.25,
        "lr": 3e-4,
        "tokens": 1000,
        "padded_tokens": 1250,
        "tokens_per_s": 20000.0,
        "num_microbatches": 3,
        "padding_efficiency": 0.8,
        "step_time_s": 0.05,
        **extra,
    }


SCRIPT = textwrap.dedent(
    """
    import sys
    from backend.logging.metrics import MetricsLogger
    m = MetricsLogger(sys.argv[1], 6, enabled=True, log_interval=int(sys.argv[2]))
    for s in range(1, 7):
        m.log({"step": s, "loss": 4.0 / s, "grad_norm": 1.25, "lr": 3e-4, "tokens": 1000, "padded_tokens": 1250,
               "tokens_per_s": 20000.0, "num_microbatches": 3, "padding_efficiency": 0.8, "step_time_s": 0.05})
        if s == 4:
            m.log_eval(4, {"valid_loss": 1.5, "valid_tokens": 800})
    """
)


def run_piped(tmp_path, log_interval: int, env_extra: dict | None = None) -> list[str]:
    import os

    env = {**os.environ, "PYTHONPATH": str(REPO), **(env_extra or {})}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "run"), str(log_interval)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_piped_output_is_one_plain_line_per_step(tmp_path):
    # FORCE_COLOR would make rich draw a live bar into the pipe on its own; ours decides by isatty
    lines = run_piped(tmp_path, 1, {"FORCE_COLOR": "1", "TTY_COMPATIBLE": "1"})
    assert len(lines) == 7, lines  # 6 steps + 1 eval
    steps = [line for line in lines if line.startswith("step ")]
    assert [line.split()[1] for line in steps] == [f"{s}/6" for s in range(1, 7)]
    for line in steps:
        for needle in ("elapsed ", "eta ", "loss ", "gnorm 1.25", "lr 3.00e-04", "20,000 tok/s", "3 mbs"):
            assert needle in line, (needle, line)
        assert "pad eff 0.800" in line and "0.05 s/step" in line
    assert lines[4] == "eval @ step 4 | valid_loss 1.5000 | valid_tokens 800"
    assert not any("\x1b" in line or "\r" in line for line in lines)  # no control codes


def test_piped_output_honours_log_interval_and_always_shows_the_last_step(tmp_path):
    lines = run_piped(tmp_path, 4)
    assert [line.split()[1] for line in lines if line.startswith("step ")] == ["4/6", "6/6"]


def test_terminal_output_redraws_in_place():
    stream = io.StringIO()
    display = ProgressDisplay(4, stream=stream, interactive=True)
    for s in range(1, 5):
        display.update(step_row(s))
    assert display.closed  # stops after the last step
    text = stream.getvalue()
    assert "\r" in text or "\x1b[" in text  # cursor control, not appended lines
    assert "4/4" in text and "loss 1.0000" in text


def test_eval_rows_go_to_metrics_jsonl_and_read_back_apart(tmp_path):
    m = MetricsLogger(tmp_path, 3, enabled=True)
    m.display = ProgressDisplay(3, stream=io.StringIO(), interactive=False)
    for s in (1, 2, 3):
        m.log(step_row(s))
    m.log_eval(2, {"valid_loss": 2.0})
    m.log_eval(3, {"valid_loss": 1.75})
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1] == {"event": "eval", "step": 3, "valid_loss": 1.75}
    train, evals = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in train] == [1, 2, 3] and [r["valid_loss"] for r in evals] == [2.0, 1.75]
    totals = m.totals()
    assert totals["steps"] == 3 and totals["tokens"] == 3000 and totals["padding_efficiency"] == 0.8
    assert totals["best_valid_loss"] == 1.75 and totals["best_valid_step"] == 3 and totals["final_loss"] == 4.0 / 3
    disabled = MetricsLogger(tmp_path / "off", 3, enabled=False)
    disabled.log_eval(1, {"valid_loss": 1.0})
    assert not (tmp_path / "off").exists()


def test_length_stats_and_durations():
    stats = length_stats([10, 20, 30, 40, 1000])
    assert stats == {
        "count": 5,
        "tokens": 1100,
        "mean": 220.0,
        "min": 10,
        "p50": 30,
        "p90": 1000,
        "p99": 1000,
        "max": 1000,
    }
    assert format_duration(5) == "00:05" and format_duration(3725) == "1:02:05" and format_duration(None) == "--:--"


def test_startup_summary_names_model_parallelism_attention_data_and_budget():
    text = format_startup_summary(
        {
            "model": "qwen3-style 2 layers x 128",
            "parameters": 1_234_567,
            "dp": 4,
            "cp": 2,
            "world_size": 8,
            "attention_backend": "sdpa",
            "data_source": "data/train.bin/.idx",
            "lengths": [100, 200, 300, 400, 5000],
            "global_batch_size": 32,
            "batching": {"dynamic": True, "max_tokens_per_gpu": 8192},
            "train_iters": 20,
            "start_step": 10,
            "schedule": "wsd, warm-up 3",
        }
    )
    lines = text.splitlines()
    assert lines[0] == "run"
    assert "qwen3-style 2 layers x 128, 1.2M parameters (1,234,567)" in text
    assert "dp 4 x cp 2, 8 rank(s)" in text and "attention  sdpa" in text
    assert "data/train.bin/.idx, 5 samples" in text and "mean 1200, p50 300, p90 5000, max 5000" in text
    assert "32 samples/step, dynamic, 8,192 tokens/GPU per microbatch" in text
    assert "20 (resuming after step 10)" in text and "wsd, warm-up 3" in text
    fixed = format_startup_summary({"batching": {"dynamic": False, "micro_batch_size": 2}})
    assert "fixed micro-batch size 2" in fixed and "model" not in fixed  # missing keys are left out
    recomputing = format_startup_summary({"attention_backend": "te", "recompute": "full"})
    assert "attention  te, recompute full" in recomputing
    experts = {"world_size": 8, "dp": 4, "cp": 2, "ep": 4, "tp": 1, "pp": 1}
    split = format_startup_summary({"dp": 4, "cp": 2, "world_size": 8, "parallel": experts})
    assert "dp 4 x cp 2, ep 4, 8 rank(s)" in split  # ParallelDims' sizes: only what is used


def test_end_summary_with_and_without_validation():
    train = [step_row(s) for s in (1, 2, 3, 4)]
    evals = [{"event": "eval", "step": 2, "valid_loss": 2.5}, {"event": "eval", "step": 4, "valid_loss": 2.75}]
    info = {**run_totals(train, evals), "wall_time_s": 65.0, "checkpoint": "runs/a/checkpoints/step_00000004"}
    text = format_end_summary(info)
    assert text.splitlines()[0] == "run finished"
    assert "steps        4" in text and "tokens       4,000 (4.0K)" in text and "wall time    01:05" in text
    assert "tokens/s     20,000 (mean)" in text and "padding eff  0.800" in text
    assert "valid loss   2.7500 (final), best 2.5000 at step 2" in text
    assert "checkpoint   runs/a/checkpoints/step_00000004" in text
    plain = format_end_summary({**run_totals(train), "status": "preempted"})
    assert plain.startswith("run preempted") and "valid loss" not in plain and "checkpoint" not in plain


def test_policy_runs_show_their_loss_clipfrac_and_ignored_fields():
    from backend.config.schema import LossConfig
    from backend.logging.console import format_step_stats
    from backend.train.trainer import describe_loss

    loss = LossConfig(type="policy", ratio_clip_high=0.28, kl_coef=0.001, reference_checkpoint="ckpt/ref")
    text = format_startup_summary({"loss": describe_loss(loss), "ignored_fields": "id (12 rows)"})
    assert "loss" in text and "policy, clip [0.8, 1.28]" in text and "k3 KL x 0.001 to ckpt/ref" in text
    assert "row fields nothing reads: id (12 rows)" in text
    assert describe_loss(LossConfig()) == "cross_entropy"
    line = format_step_stats({"loss": -0.0123, "clipfrac": 0.0625, "grad_norm": 1.0})
    assert "loss -0.0123" in line and "clipfrac 0.062" in line
    assert "clipfrac" not in format_step_stats({"loss": 2.0})
