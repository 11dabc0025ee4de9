"""Context parallelism trains the same model as cp 1, for fixed and dynamic plans (FP32, CPU)."""

from __future__ import annotations

import pytest

from backend.bench.compare import compare, run_arm
from tests.conftest import TINY

from .test_train_equivalence import STEPS, assert_same_training

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def cp_arms(tmp_path_factory, embedded_cache):
    out = tmp_path_factory.mktemp("cp_arms")
    data = [f"data.cache_dir={embedded_cache}"]
    fixed = data + ["train.dynamic_batch_enable=false", "train.micro_batch_size=2"]
    dynamic = data + ["train.dynamic_batch_enable=true"]

    def arm(name, overrides, cp, nproc):
        return run_arm(
            TINY, overrides + [f"parallel.context_parallel_size={cp}"], nproc=nproc, steps=STEPS, out_dir=out, name=name
        )

    return {
        "fixed_dp2_cp1": arm("fixed_dp2_cp1", fixed, 1, 2),
        "fixed_dp2_cp2": arm("fixed_dp2_cp2", fixed, 2, 4),
        "dynamic_dp2_cp1": arm("dynamic_dp2_cp1", dynamic, 1, 2),
        "dynamic_dp2_cp2": arm("dynamic_dp2_cp2", dynamic, 2, 4),
        "dynamic_dp1_cp1": arm("dynamic_dp1_cp1", dynamic, 1, 1),
        "dynamic_dp1_cp4": arm("dynamic_dp1_cp4", dynamic, 4, 4),
        # Full recomputation re-runs each layer (its CP all-gather included) in backward, on 2 ranks.
        "recompute_dp1_cp2": arm(
            "recompute_dp1_cp2",
            dynamic + ["model.recompute_granularity=full", "train.dynamic_batch_layout=packed"],
            2,
            2,
        ),
    }


@pytest.mark.parametrize("kind", ["fixed", "dynamic"])
def test_dp2_cp2_matches_dp2_cp1(cp_arms, kind):
    assert_same_training(compare(cp_arms[f"{kind}_dp2_cp1"], cp_arms[f"{kind}_dp2_cp2"]))


def test_dp1_cp4_matches_dp1_cp1(cp_arms):
    assert cp_arms["dynamic_dp1_cp4"]["world_size"] == 4
    assert_same_training(compare(cp_arms["dynamic_dp1_cp1"], cp_arms["dynamic_dp1_cp4"]))


def test_full_recomputation_under_cp2_packed_trains_the_same(cp_arms):
    """FSDP2 over 2 ranks, CP 2, packed rows, every layer recomputed in backward: the same training
    as cp 1 without recomputation (to FP32 noise, as every CP arm)."""
    assert cp_arms["recompute_dp1_cp2"]["world_size"] == 2
    assert_same_training(compare(cp_arms["dynamic_dp1_cp1"], cp_arms["recompute_dp1_cp2"]))
