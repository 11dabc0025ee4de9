"""GPT-OSS config fields, parameter count and tensor mapping (import direction)."""

from __future__ import annotations

import pytest
import torch
import transformers  # noqa: E402  (a dev dependency: a missing one fails, never skips)

from backend.config.hf import HFConfigError  # noqa: E402
from backend.model.attention.layout import layer_window  # noqa: E402
from backend.model.hf.gpt_oss import (  # noqa: E402
    GPT_OSS_20B,
    GPT_OSS_20B_PARAMETERS,
    gpt_oss_fields,
    gpt_oss_num_parameters,
    gpt_oss_param_maps,
    read_expert_tensor,
)

TINY = dict(
    num_hidden_layers=3,
    num_local_experts=4,
    num_experts_per_tok=2,
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    head_dim=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    sliding_window=6,
)


def test_fields_from_a_gpt_oss_config():
    f = gpt_oss_fields(transformers.GptOssConfig(**TINY).to_dict())
    assert f["window_attn_skip_freq"] == [1, 0, 1]  # sliding, full, sliding (HF's default pattern)
    assert [layer_window((f["sliding_window"] - 1, 0), f["window_attn_skip_freq"], n) for n in (1, 2, 3)] == [6, 0, 6]
    assert f["rope_scaling"]["rope_type"] == "yarn" and f["rope_scaling"]["truncate"] is False
    assert f["rotary_base"] == 150000.0 and f["qkv_bias"] and f["attention_sinks"]
    assert (f["num_moe_experts"], f["moe_router_topk"], f["swiglu_limit"]) == (4, 2, 7.0)
    with pytest.raises(HFConfigError, match="quantization"):
        gpt_oss_fields({**transformers.GptOssConfig(**TINY).to_dict(), "quantization_config": {"quant_method": "gptq"}})


def test_20b_parameter_count():
    fields = gpt_oss_fields(transformers.GptOssConfig(**GPT_OSS_20B).to_dict())
    assert gpt_oss_num_parameters(fields) == GPT_OSS_20B_PARAMETERS == 20_914_757_184
    with torch.device("meta"):
        model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**GPT_OSS_20B))
    assert sum(p.numel() for p in model.parameters()) == GPT_OSS_20B_PARAMETERS


def test_param_maps_cover_every_hf_tensor():
    cfg = transformers.GptOssConfig(**TINY)
    torch.manual_seed(0)
    hf = transformers.GptOssForCausalLM(cfg)
    state = hf.state_dict()
    fields = gpt_oss_fields(cfg.to_dict())
    maps = gpt_oss_param_maps(fields)
    used = {n for pm in maps for n in pm.hf}
    assert used == set(state)
    assert len({pm.megatron for pm in maps}) == len(maps)
    assert sum(pm.to_megatron([state[n] for n in pm.hf]).numel() for pm in maps) == gpt_oss_num_parameters(fields)
    byname = {pm.megatron: pm for pm in maps}
    fc1 = byname["decoder.layers.1.mlp.experts.fc1_weight"]
    w = fc1.to_megatron([state[n] for n in fc1.hf])[3]  # expert 3: [hidden, 2I], gate units first
    gate_up = state["model.layers.1.mlp.experts.gate_up_proj"][3]  # [hidden, 2I], interleaved
    assert torch.equal(w[:, :48], gate_up[:, 0::2]) and torch.equal(w[:, 48:], gate_up[:, 1::2])


def test_read_expert_tensor_dequantises_mxfp4_pairs():
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (2, 6, 1, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(120, 130, (2, 6, 1), generator=g, dtype=torch.uint8)
    store = {"x.down_proj_blocks": blocks, "x.down_proj_scales": scales, "x.down_proj_bias": torch.ones(2, 32)}
    dense = read_expert_tensor(set(store), store.__getitem__, "x.down_proj", torch.bfloat16)
    assert dense.shape == (2, 32, 6) and dense.dtype == torch.bfloat16
    assert torch.equal(
        read_expert_tensor(set(store), store.__getitem__, "x.down_proj_bias", torch.float32), store["x.down_proj_bias"]
    )
    with pytest.raises(KeyError, match="MXFP4"):
        read_expert_tensor(set(store), store.__getitem__, "x.gate_up_proj", torch.float32)
