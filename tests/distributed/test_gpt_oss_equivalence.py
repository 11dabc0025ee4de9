"""GPT-OSS (tiny, imported from a HF directory): fixed micro-batch size 1 and dynamic batching at dp 2
train the same model with the MoE load-balancing loss on (FP32, CPU, 3 steps).

The aux loss is per sample and normalised per window (backend.model.moe_stats), so the plan does
not change it; the router statistics (tokens per expert, aux loss) agree too.
"""

from __future__ import annotations

import pytest

from backend.bench.compare import compare, run_arm
from tests.conftest import REPO

pytestmark = pytest.mark.distributed

HF_TINY = str(REPO / "tests" / "configs" / "hf_tiny.yaml")
STEPS = 3


@pytest.fixture(scope="module")
def arms(tmp_path_factory, embedded_cache):
    from tests.helpers.hf_tiny import tiny_gpt_oss_model

    out = tmp_path_factory.mktemp("oss_arms")
    tiny_gpt_oss_model(out / "hf")
    common = [
        f"model.hf_checkpoint={out / 'hf'}",
        "model.moe_aux_loss_coeff=0.9",
        "data.path=embedded",
        f"data.cache_dir={embedded_cache}",
        "data.tokenizer=byte",
        "data.overlong=truncate",
    ]
    fixed = common + ["train.dynamic_batch_enable=false", "train.micro_batch_size=1"]
    dynamic = common + ["train.dynamic_batch_enable=true"]
    return {
        "fixed": run_arm(HF_TINY, fixed, nproc=2, steps=STEPS, out_dir=out, name="fixed_dp2"),
        "dynamic": run_arm(HF_TINY, dynamic, nproc=2, steps=STEPS, out_dir=out, name="dynamic_dp2"),
    }


def test_fixed_mbs1_and_dynamic_give_the_same_moe_training(arms):
    result = compare(arms["fixed"], arms["dynamic"])
    print({k: result[k] for k in ("loss_rel_diff", "grad_cosine", "max_param_diff")})
    assert result["num_microbatches_other"] < result["num_microbatches_ref"]  # several rows per microbatch
    assert result["padding_efficiency_other"] < 1.0
    assert result["loss_rel_diff"] <= 1e-6, result
    assert result["grad_cosine"] >= 0.99999, result
    assert result["max_param_diff"] <= 1e-5, result
    for key in ("moe_aux_loss", "moe_tokens_per_expert_max_over_mean"):
        ref, other = arms["fixed"][key], arms["dynamic"][key]
        print(key, ref, other)
        assert len(ref) == STEPS and all(abs(a - b) <= 1e-6 * abs(a) for a, b in zip(ref, other, strict=True))
    assert all(a > 0.5 for a in arms["fixed"]["moe_aux_loss"])  # not vacuous: the loss is on
