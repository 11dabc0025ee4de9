"""config.json -> our model fields: the three supported families, refusals, explicit-key conflicts."""

from __future__ import annotations

import json

import pytest
import transformers  # noqa: E402,F401  (a dev dependency: a missing one fails, never skips)

from backend.config.hf import (  # noqa: E402
    FIELDS,
    HFConfigError,
    check_against_explicit,
    fields_from_hf,
    read_hf_config,
)
from tests.helpers.hf_tiny import tiny_hf_config  # noqa: E402


def _saved(kind, tmp_path, **changes):
    cfg = tiny_hf_config(kind).to_dict()
    cfg.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_qwen3_fields(tmp_path):
    f = read_hf_config(_saved("qwen3", tmp_path))
    assert tuple(f) == FIELDS
    assert f == {
        "model_type": "qwen3",
        "num_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_query_groups": 2,
        "ffn_hidden_size": 96,
        "vocab_size": 300,
        "max_position_embeddings": 256,
        "rotary_base": 1_000_000.0,
        "head_dim": 32,
        "norm_epsilon": 1e-6,
        "qk_layernorm": True,
        "qkv_bias": False,
        "tie_embeddings": True,
        "rope_scaling": None,
    }


def test_llama_and_qwen2_fields(tmp_path):
    (tmp_path / "l").mkdir()
    (tmp_path / "q").mkdir()
    llama = read_hf_config(_saved("llama", tmp_path / "l"))
    assert llama["head_dim"] == 16 and llama["norm_epsilon"] == 1e-5 and not llama["qk_layernorm"]
    assert llama["rope_scaling"]["rope_type"] == "llama3" and "rope_theta" not in llama["rope_scaling"]
    assert llama["rotary_base"] == 500_000.0 and not llama["tie_embeddings"] and not llama["qkv_bias"]
    qwen2 = read_hf_config(_saved("qwen2", tmp_path / "q"))
    assert qwen2["qkv_bias"] and not qwen2["qk_layernorm"] and qwen2["rope_scaling"]["rope_type"] == "yarn"


def test_legacy_4x_keys():
    # A Qwen2.5-style config: rope_theta and rope_scaling at the top, a sliding_window number unused.
    cfg = {
        "model_type": "qwen2",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "intermediate_size": 96,
        "vocab_size": 300,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
        "sliding_window": 131072,
        "use_sliding_window": False,
        "tie_word_embeddings": True,
    }
    f = fields_from_hf(cfg)
    assert f["rotary_base"] == 1e6 and isinstance(f["rotary_base"], float)
    assert f["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    assert f["tie_embeddings"] and f["head_dim"] == 16


@pytest.mark.parametrize(
    "kind,change,needle",
    [
        ("llama", {"model_type": "mistral"}, "model_type 'mistral'"),
        ("llama", {"hidden_act": "gelu"}, "'hidden_act' = 'gelu'"),
        ("llama", {"mlp_bias": True}, "'mlp_bias' = True"),
        ("llama", {"attention_bias": True}, "'attention_bias' = True"),
        ("qwen2", {"use_sliding_window": True}, "'use_sliding_window' = True"),
        ("qwen3", {"layer_types": ["full_attention", "sliding_attention"]}, "sliding_attention"),
        ("qwen3", {"attention_dropout": 0.1}, "'attention_dropout' = 0.1"),
        ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "'dynamic'"),
        ("llama", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}}, "low_freq_factor"),
        ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ("qwen3", {"num_key_value_heads": 3}, "num_key_value_heads"),
        ("qwen3", {"rms_norm_eps": None}, "rms_norm_eps"),
        ("qwen3", {"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ],
)
def test_refusals_name_field_and_file(tmp_path, kind, change, needle):
    path = _saved(kind, tmp_path, **change)
    with pytest.raises(HFConfigError) as e:
        read_hf_config(path)
    assert needle in str(e.value) and str(path / "config.json") in str(e.value)


def test_missing_config_json(tmp_path):
    with pytest.raises(HFConfigError, match="no config.json"):
        read_hf_config(tmp_path)


def test_check_against_explicit(tmp_path):
    f = read_hf_config(_saved("qwen3", tmp_path))
    # Agreeing, unrelated and "derive it" (0) keys pass; 1000000 equals 1e6.
    check_against_explicit(
        f,
        {
            "model.hidden_size": 64,
            "model.rotary_base": 1000000,
            "model.attention_backend": "sdpa",
            "model.ffn_hidden_size": 0,
            "model.tie_embeddings": True,
        },
    )
    with pytest.raises(HFConfigError) as e:
        check_against_explicit(f, {"model.hidden_size": 128, "model.qk_layernorm": False}, source="ckpt/config.json")
    msg = str(e.value)
    assert "model.hidden_size=128" in msg and "hidden_size=64" in msg and "ckpt/config.json" in msg
    assert "model.qk_layernorm=False" in msg and "qk_layernorm=True" in msg
