"""Fixed versus dynamic microbatching, and dp 1 versus dp 2, train the same model (FP32, CPU).

Each arm is a real torchrun process group; both start from the same weights and draw the same
windows. Any difference beyond floating-point summation order would be a bug.
"""

from __future__ import annotations

import pytest

from backend.bench.compare import compare, run_arm
from tests.conftest import TINY

pytestmark = pytest.mark.distributed

STEPS = 3


def assert_same_training(result: dict) -> None:
    assert result["loss_rel_diff"] <= 1e-6, result
    assert result["grad_cosine"] >= 0.99999, result
    assert result["max_param_diff"] <= 1e-5, result


@pytest.fixture(scope="module")
def arms(tmp_path_factory, embedded_cache):
    out = tmp_path_factory.mktemp("arms")
    data = [f"data.cache_dir={embedded_cache}"]
    fixed = data + ["train.dynamic_batch_enable=false", "train.micro_batch_size=1"]
    dynamic = data + ["train.dynamic_batch_enable=true"]
    return {
        "fixed_dp2": run_arm(TINY, fixed, nproc=2, steps=STEPS, out_dir=out, name="fixed_dp2"),
        "dynamic_dp2": run_arm(TINY, dynamic, nproc=2, steps=STEPS, out_dir=out, name="dynamic_dp2"),
        "dynamic_dp1": run_arm(TINY, dynamic, nproc=1, steps=STEPS, out_dir=out, name="dynamic_dp1"),
    }


def test_fixed_mbs1_and_dynamic_give_the_same_training(arms):
    result = compare(arms["fixed_dp2"], arms["dynamic_dp2"])
    # Not vacuous: the dynamic arm really packs several padded rows per microbatch.
    assert result["num_microbatches_other"] < result["num_microbatches_ref"] / 2
    assert result["padding_efficiency_other"] < 1.0
    assert_same_training(result)


def test_dp1_and_dp2_give_the_same_training(arms):
    assert arms["dynamic_dp1"]["world_size"] == 1 and arms["dynamic_dp2"]["world_size"] == 2
    assert_same_training(compare(arms["dynamic_dp1"], arms["dynamic_dp2"]))


def test_training_makes_progress(arms):
    losses = arms["dynamic_dp2"]["loss"]
    assert losses[-1] < losses[0]
