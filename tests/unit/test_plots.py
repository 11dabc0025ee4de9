"""tools/plot/plot_plan.py and tools/plot_metrics.py: PNGs written, decodable, of the promised size."""

from __future__ import annotations

import importlib
import importlib.util
import json
from pathlib import Path

import matplotlib  # noqa: E402,F401  (a dev dependency: a missing one fails, never skips)
import matplotlib.image as mpimg  # noqa: E402
import pytest

from backend.batching import plan_dynamic  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def tool(name: str):
    if name == "plot_metrics":  # a user command: tools/plot_metrics.py runs backend.commands.plot_metrics
        return importlib.import_module("backend.commands.plot_metrics")
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / "plot" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pixels(path: Path) -> tuple[int, int]:
    """(height, width) of a PNG, decoded."""
    image = mpimg.imread(path)
    assert image.ndim == 3 and image.shape[2] in (3, 4) and float(image[..., :3].std()) > 0.01  # not blank
    return image.shape[0], image.shape[1]


def test_plot_plan_from_a_lengths_file(tmp_path, capsys):
    plot_plan = tool("plot_plan")
    lengths = [50, 3000, 120, 800, 90, 12000, 400, 64, 2048, 700, 30, 1500]  # 12000 is over the budget alone
    (tmp_path / "lengths.txt").write_text("# one per line\n" + "\n".join(map(str, lengths)) + "\n")
    out = tmp_path / "plan.png"
    argv = ["--lengths-file", str(tmp_path / "lengths.txt"), "--dp", "3", "--max-tokens-per-gpu", "4096"]
    assert plot_plan.main([*argv, "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    w, h = plot_plan.figure_size(3)
    assert pixels(out) == (round(h * 100), round(w * 100))


def test_plot_plan_marks_empty_microbatches_and_windows_of_a_file(tmp_path):
    plot_plan = tool("plot_plan")
    # 3 sequences on 4 ranks: some rank runs only an empty microbatch
    step_plan = plan_dynamic([100, 200, 5000], dp_size=4, max_tokens_per_gpu=4096)
    assert step_plan.empty_microbatches and step_plan.oversize_singletons == 1
    out = plot_plan.draw_plan(step_plan, tmp_path / "sub" / "empty.png", title="tiny")
    w, h = plot_plan.figure_size(4)
    assert pixels(out) == (round(h * 100), round(w * 100))
    (tmp_path / "l.txt").write_text("\n".join(["100"] * 10))
    argv = ["--lengths-file", str(tmp_path / "l.txt"), "--global-batch-size", "4", "--step", "3", "--dp", "2"]
    assert plot_plan.main([*argv, "--micro-batch-size", "1", "--out", str(tmp_path / "w.png")]) == 0  # 2 of 4 left
    with pytest.raises(SystemExit, match="no window 4"):
        plot_plan.main(["--lengths-file", str(tmp_path / "l.txt"), "--global-batch-size", "4", "--step", "4"])


def test_plot_plan_from_a_config_builds_the_trainers_window(tmp_path):
    plot_plan = tool("plot_plan")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": "x" * (20 + 37 * i % 400)}) + "\n" for i in range(64)))
    overrides = [
        f"data.path={data}",
        "train.global_batch_size=16",
        "train.dynamic_batch_enable=true",
        "train.max_tokens_per_gpu=1024",
    ]
    out = tmp_path / "cfg.png"
    config = tmp_path / "c.yaml"
    config.write_text("train:\n  seed: 7\n")
    step_plan, what = plot_plan.plan_from_config(str(config), overrides, dp=2, cp=None, step=2)
    assert step_plan.dp_size == 2 and step_plan.num_sequences == 16 and "step 2" in what
    assert plot_plan.main([str(config), *overrides, "--dp", "2", "--cp", "1", "--step", "2", "--out", str(out)]) == 0
    w, h = plot_plan.figure_size(2)
    assert pixels(out) == (round(h * 100), round(w * 100))
    assert plot_plan.main([str(config), "train.global_batch_size=0", "--out", str(out)]) == 1  # a config error


def write_run(run: Path, steps: int, *, evals: bool, scale: float = 1.0) -> Path:
    run.mkdir(parents=True)
    rows = []
    for s in range(1, steps + 1):
        rows.append(
            {
                "step": s,
                "loss": scale * 5.0 / s**0.5,
                "lr": 1e-3 * min(1.0, s / 3),
                "tokens_per_s": 9000 + 100 * s,
                "padding_efficiency": 0.9,
                "padding_efficiency_min_rank": 0.85,
                "rank_imbalance": 0.05,
                "step_time_s": 1.2,
                "kind": "dynamic",
            }
        )
        if evals and s % 5 == 0:
            rows.append({"event": "eval", "step": s, "valid_loss": scale * 5.5 / s**0.5})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 99, "lo')
    return run


def test_plot_metrics_overlays_runs_with_validation(tmp_path, capsys):
    plot_metrics = tool("plot_metrics")
    a = write_run(tmp_path / "runA", 20, evals=True)
    b = write_run(tmp_path / "runB", 15, evals=False, scale=1.1)
    out = tmp_path / "m.png"
    assert plot_metrics.main([str(a), str(b / "metrics.jsonl"), "--out", str(out)]) == 0
    assert "2 run(s)" in capsys.readouterr().out
    assert pixels(out) == (850, 1500)
    assert plot_metrics.run_labels([a / "metrics.jsonl", b / "metrics.jsonl"]) == ["runA", "runB"]
    assert plot_metrics.main([str(tmp_path / "nothing"), "--out", str(out)]) == 1
