"""The packed layout trains the same model as padded rows and as fixed micro-batch size 1 (FP32,
CPU, 3 steps), at dp 2 and at dp 2 x cp 2: one combined module-scoped fixture of real torchrun arms."""

from __future__ import annotations

import pytest

from backend.bench.compare import compare, run_arm
from tests.conftest import TINY

from .test_train_equivalence import STEPS, assert_same_training

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def packed_arms(tmp_path_factory, embedded_cache):
    out = tmp_path_factory.mktemp("packed_arms")
    data = [f"data.cache_dir={embedded_cache}"]
    fixed = data + ["train.dynamic_batch_enable=false", "train.micro_batch_size=1"]
    padded = data + ["train.dynamic_batch_enable=true", "train.dynamic_batch_layout=padded"]
    packed = data + ["train.dynamic_batch_enable=true", "train.dynamic_batch_layout=packed"]

    def arm(name, overrides, cp):
        nproc = 2 * cp
        return run_arm(
            TINY, overrides + [f"parallel.context_parallel_size={cp}"], nproc=nproc, steps=STEPS, out_dir=out, name=name
        )

    return {
        "fixed_cp1": arm("fixed_cp1", fixed, 1),
        "padded_cp1": arm("padded_cp1", padded, 1),
        "packed_cp1": arm("packed_cp1", packed, 1),
        "packed_cp2": arm("packed_cp2", packed, 2),
        "padded_cp2": arm("padded_cp2", padded, 2),
    }


def _report(name: str, result: dict) -> dict:
    keys = ("loss_rel_diff", "grad_cosine", "max_param_diff", "num_microbatches_ref", "num_microbatches_other")
    print(name, {k: result[k] for k in keys})  # shown with pytest -s
    return result


def test_packed_equals_padded_and_fixed_at_dp2(packed_arms):
    vs_padded = _report("padded vs packed dp2", compare(packed_arms["padded_cp1"], packed_arms["packed_cp1"]))
    # Not vacuous: packing needs fewer microbatches and pads (almost) nothing.
    assert vs_padded["num_microbatches_other"] <= vs_padded["num_microbatches_ref"]
    assert vs_padded["padding_efficiency_other"] > vs_padded["padding_efficiency_ref"]
    assert vs_padded["padding_efficiency_other"] == 1.0
    assert_same_training(vs_padded)
    assert_same_training(_report("fixed vs packed dp2", compare(packed_arms["fixed_cp1"], packed_arms["packed_cp1"])))


def test_packed_at_dp2_cp2_equals_padded_and_fixed(packed_arms):
    assert packed_arms["packed_cp2"]["world_size"] == 4
    assert_same_training(_report("padded vs packed cp2", compare(packed_arms["padded_cp2"], packed_arms["packed_cp2"])))
    assert_same_training(_report("fixed vs packed cp2", compare(packed_arms["fixed_cp1"], packed_arms["packed_cp2"])))
    assert_same_training(_report("packed cp1 vs cp2", compare(packed_arms["packed_cp1"], packed_arms["packed_cp2"])))
