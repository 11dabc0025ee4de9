"""LoRA (``model.lora``) under the parallel layouts, against one process, on a tiny random Hugging
Face Qwen3 (real gloo ranks, FP32, 3 steps of cross-entropy, adapters on all seven projections):

- TP 2 (sequence parallel: A of q/k/v and gate/up whole on each rank with its gradient added over
  TP, B split; A of o_proj / down_proj split, B whole with its gradient added over TP) and
  TP 2 without sequence parallelism (the adapters' input copied into the TP region, x A^T summed
  over TP), dp 2 (FSDP2 sharding the adapters beside the frozen base), CP 2 and PP 2 (each stage
  its layers' adapters) each train like one process: loss
  within 1e-6 relative, gradient cosine >= 0.999999, weights within FP32 rounding after Adam;
- the frozen base stays bitwise the imported one on every layout (its updates are exactly 0).
"""

from __future__ import annotations

import pytest

from backend.bench.compare import compare, run_arm
from tests.conftest import REPO

pytestmark = pytest.mark.distributed

HF_TINY = str(REPO / "tests" / "configs" / "hf_tiny.yaml")
LORA = ["model.lora.rank=4", "model.lora.alpha=8"]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    from tests.helpers.hf_tiny import tiny_hf_model

    root = tmp_path_factory.mktemp("lora_parallel")
    tiny_hf_model("qwen3", root / "hf")
    return root


def _arm(root, cache, name, nproc, *extra):
    overrides = [
        f"model.hf_checkpoint={root / 'hf'}",
        "data.path=embedded",
        f"data.cache_dir={cache}",
        "data.tokenizer=byte",
        "data.overlong=truncate",
        *LORA,
        *extra,
    ]
    return run_arm(HF_TINY, overrides, nproc=nproc, steps=3, out_dir=root / "arms", name=name)


@pytest.fixture(scope="module")
def one_process(qwen3, embedded_cache):
    return _arm(qwen3, embedded_cache, "tp1", 1)


@pytest.mark.parametrize(
    ("name", "extra"),
    [
        ("tp2", ["parallel.tensor_parallel_size=2"]),
        ("tp2_no_sp", ["parallel.tensor_parallel_size=2", "parallel.sequence_parallel=false"]),
        ("dp2", []),
        ("cp2", ["parallel.context_parallel_size=2"]),
        ("pp2", ["parallel.pipeline_parallel_size=2"]),
    ],
)
def test_lora_trains_at_tp2_and_dp2_as_one_process(qwen3, embedded_cache, one_process, name, extra):
    other = _arm(qwen3, embedded_cache, name, 2, *extra)
    result = compare(one_process, other)
    print(name, {k: result[k] for k in ("loss_rel_diff", "grad_cosine", "max_param_diff")})
    assert result["loss_rel_diff"] <= 1e-6, result
    assert result["grad_cosine"] >= 0.999999, result
    assert result["max_param_diff"] <= 2e-5, result
    assert float(other["update"][-1].abs().max()) > 0  # the adapters did train
    # The same entries change on both layouts, under a quarter of them (the frozen base by exactly 0).
    changed_ref = sum(u != 0 for u in one_process["update"]).bool()
    changed_other = sum(u != 0 for u in other["update"]).bool()
    assert bool((changed_ref == changed_other).all())
    assert 0 < int(changed_ref.sum()) < changed_ref.numel() // 4
