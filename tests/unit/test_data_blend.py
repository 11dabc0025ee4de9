"""Weighted data blends (``data.blend``): each source's share of the stream, exact resume (the
sampler's and a real run's), the step rows' per-source counts, and the config's refusals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from backend.config import ConfigError, load_config, validate
from backend.data.blend import BlendSampler, blend_sources
from backend.logging.metric_keys import undocumented
from tests.conftest import TINY


def test_a_blend_draws_each_source_by_its_weight():
    """0.25 / 0.75 over 400 samples: each source within 3 sigma of its weight (the greedy rule
    keeps it within one sample, window after window)."""
    sampler = BlendSampler([150, 500], [0.25, 0.75], 16, seed=3)
    ids = np.concatenate([sampler.next_window() for _ in range(25)])
    from_a = int((ids < 150).sum())
    sigma = (400 * 0.25 * 0.75) ** 0.5
    assert abs(from_a - 100) <= 3 * sigma
    assert abs(from_a - 100) <= 1  # not just likely: by construction
    picks = blend_sources([1, 3], 0, 400)
    for n in range(1, 401):
        assert abs(int((picks[:n, 0] == 0).sum()) - n / 4) <= 1
    # within a source, every sample once per pass (seeded permutations)
    a = ids[ids < 150]
    assert len(set(a.tolist())) == len(a)
    assert set(BlendSampler([150, 500], [1, 3], 400, seed=3).next_window().tolist()) <= set(range(650))


def test_a_resumed_blend_continues_the_same_stream():
    whole = BlendSampler([37, 11, 90], [2, 1, 5], 12, seed=7)
    first = [whole.next_window() for _ in range(9)]  # source 1 wraps into its second pass
    half = BlendSampler([37, 11, 90], [2, 1, 5], 12, seed=7)
    for _ in range(4):
        half.next_window()
    resumed = BlendSampler([37, 11, 90], [2, 1, 5], 12, seed=7)
    resumed.load_state_dict(json.loads(json.dumps(half.state_dict())))  # as a checkpoint holds it
    assert all(np.array_equal(a, resumed.next_window()) for a in first[4:])
    other = BlendSampler([37, 11, 90], [1, 1, 5], 12, seed=7)
    with pytest.raises(Exception, match=r"cannot resume the blended data stream: the checkpoint's weights"):
        other.load_state_dict(half.state_dict())


def test_blend_config_refusals():
    blend = "data.blend=[{path: a.jsonl, weight: 1}, {path: a.jsonl, weight: 0}]"
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, [blend, "data.path=b.jsonl", "data.valid_fraction=0.1"]))
    text = str(e.value)
    assert "data.blend: set either data.path ('b.jsonl') or data.blend, not both" in text
    assert "data.blend: not with data.valid_fraction" in text
    assert "data.blend: 'a.jsonl' is listed twice" in text
    assert "data.blend[1].weight=0.0: must be > 0" in text


def _rows_file(path: Path, name: str, n: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    lines = [json.dumps({"text": f"{name} {i} " + "ab" * int(rng.integers(3, 40))}) for i in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _train(world, run_dir: Path, overrides: list[str]) -> list[dict]:
    from backend.train.trainer import Trainer

    keys = [f"logger.run_dir={run_dir}", "logger.log_interval=1000", *overrides]
    trainer = Trainer(validate(load_config(TINY, keys)), world)
    trainer.train()
    trainer.metrics.close()
    for lock in trainer.locks:
        lock.release()
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_blended_run_logs_its_sources_and_resumes_exactly(world, tmp_path):
    a = _rows_file(tmp_path / "a.jsonl", "a", 40, 1)
    b = _rows_file(tmp_path / "b.jsonl", "b", 70, 2)
    blend = [
        f"data.blend=[{{path: {a}, weight: 0.25}}, {{path: {b}, weight: 0.75}}]",
        "data.path=embedded",
        "data.valid_fraction=0",
        "train.eval_interval=0",
        "train.global_batch_size=8",
        "data.tokenizer=byte",
    ]
    whole = _train(world, tmp_path / "whole", [*blend, "train.train_iters=4", "checkpoint.interval=0"])
    assert not undocumented(whole)
    assert [r["blend_samples"] for r in whole] == [{a: 2, b: 6}] * 4
    part = tmp_path / "part"
    _train(world, part, [*blend, "train.train_iters=2", "checkpoint.interval=2"])
    resumed = _train(world, part, [*blend, "train.train_iters=4", "checkpoint.interval=2"])
    assert [r["step"] for r in resumed[-2:]] == [3, 4]
    assert [r["loss"] for r in resumed[-2:]] == [r["loss"] for r in whole[2:]]  # the same windows, bitwise
