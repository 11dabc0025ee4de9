"""Tensor parallelism with attention sinks (each TP rank keeps its heads' sinks; sliding windows
unchanged) and with a critic (the one-output value head whole on every TP rank, its input
gathered over sequence parallelism): TP 2 trains like TP 1 for 3 steps, real gloo ranks. Loss
within 1e-6 relative, gradient cosine >= 0.999999, weights within 2e-5 (as the other TP arms)."""

from __future__ import annotations

import pytest

from backend.bench.compare import compare, run_arm
from tests.conftest import TINY

from .test_value_equivalence import _rows

pytestmark = pytest.mark.distributed

STEPS = 3
ARMS = {
    "sinks_windows": ["model.attention_sinks=true", "model.sliding_window=24", "model.window_attn_skip_freq=[1,0]"],
    "critic": ["model.head=value", "loss.type=value", "train.dynamic_batch_layout=packed"],
}


@pytest.mark.parametrize("name", list(ARMS))
def test_tp2_trains_like_tp1(tmp_path, name):
    overrides = [*ARMS[name], "train.dynamic_batch_enable=true"]
    if name == "critic":
        overrides.append(f"data.path={_rows(tmp_path / 'rows.jsonl')}")
    ref = run_arm(str(TINY), overrides, nproc=1, steps=STEPS, out_dir=tmp_path, name=f"{name}_tp1")
    other = run_arm(
        str(TINY),
        [*overrides, "parallel.tensor_parallel_size=2"],
        nproc=2,
        steps=STEPS,
        out_dir=tmp_path,
        name=f"{name}_tp2",
    )
    result = compare(ref, other)
    print(name, {k: result[k] for k in ("loss_rel_diff", "grad_cosine", "max_param_diff")})
    assert other["tensor_parallel_size"] == 2
    assert result["loss_rel_diff"] <= 1e-6, result
    assert result["grad_cosine"] >= 0.999999, result
    assert result["max_param_diff"] <= 2e-5, result
    assert 2 * other["layer_numel_held"] == other["layer_numel_whole"] == ref["layer_numel_held"] > 0
