"""Our RoPE inverse frequencies equal transformers' ROPE_INIT_FUNCTIONS for every supported type."""

from __future__ import annotations

import pytest
import torch

from backend.model.hf.rope import cos_sin, inv_freq  # noqa: E402

CASES = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
    "yarn_betas": {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 512,
        "beta_fast": 16.0,
        "beta_slow": 2.0,
    },
    "yarn_mscale": {
        "rope_type": "yarn",
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "mscale": 1.0,
        "mscale_all_dim": 0.707,
    },
    "yarn_no_truncate": {
        "rope_type": "yarn",
        "factor": 2.0,
        "original_max_position_embeddings": 128,
        "truncate": False,
    },
}


def _reference(head_dim: int, base: float, params: dict) -> tuple[torch.Tensor, float]:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=1024,
        rope_parameters={"rope_theta": base, **params},
    )
    if params["rope_type"] == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        return LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
    return ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg, "cpu")


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("head_dim,base", [(32, 10000.0), (128, 500000.0), (64, 1_000_000.0)])
def test_inv_freq_equals_transformers(name, head_dim, base):
    params = CASES[name]
    ours, factor = inv_freq(head_dim, base, params, max_position_embeddings=1024)
    ref, ref_factor = _reference(head_dim, base, params)
    assert ours.dtype == torch.float32 and ours.shape == (head_dim // 2,)
    assert torch.equal(ours, ref.float()), (ours - ref).abs().max()
    assert factor == pytest.approx(ref_factor, abs=1e-12)


def test_yarn_attention_factor_value():
    # 0.1 * ln(4) + 1: the mscale that multiplies cos and sin.
    _, factor = inv_freq(32, 10000.0, CASES["yarn"])
    assert factor == pytest.approx(1.1386294361, abs=1e-9)


def test_none_scaling_is_default_and_cos_sin_scaled():
    a, fa = inv_freq(32, 10000.0, None)
    b, fb = inv_freq(32, 10000.0, {"type": "default"})
    assert torch.equal(a, b) and fa == fb == 1.0
    pos = torch.arange(5)[None]
    cos, sin = cos_sin(pos, a, 2.0, torch.float32)
    assert cos.shape == (1, 5, 32)
    assert torch.allclose(cos[0, 0], torch.full((32,), 2.0))
    assert torch.allclose(sin[0, 0], torch.zeros(32))


def test_unknown_rope_type_is_refused_by_name():
    with pytest.raises(ValueError, match="dynamic"):
        inv_freq(32, 10000.0, {"rope_type": "dynamic", "factor": 2.0})
