"""GPT-OSS (``model_type: gpt_oss``) <-> megatron-core GPTModel: config fields and tensor layouts.

``gpt_oss_fields`` reads a config.json dict (the base fields of ``config.FIELDS`` plus GPT-OSS's:
attention biases, sinks, per-layer sliding windows, experts); ``gpt_oss_param_maps`` lists every
megatron-core parameter with its HF sources and the way back (export). The MoE MLP's layouts:

Transformers' ``GptOssMLP`` = ``router`` (``GptOssTopKRouter``) + ``experts`` (``GptOssExperts``):

- ``mlp.router.weight`` [E, hidden], ``mlp.router.bias`` [E] -> megatron-core ``mlp.router.weight`` /
  ``mlp.router.bias``, copied (top-k over logits + bias, softmax over the k: see ``moe_compat``).
- ``mlp.experts.gate_up_proj`` [E, hidden, 2I] is *in-major* (``x @ W``) and *interleaved*: column
  2i is gate unit i, column 2i + 1 is up unit i. Our stacked experts (``grouped_experts``) hold
  ``mlp.experts.fc1_weight`` [E, hidden, 2I], in-major too, with all gate units first, then all up
  units (megatron-core's GLU order): ``fc1_weight = deinterleave_gate_up(gate_up_proj)``.
- ``mlp.experts.gate_up_proj_bias`` [E, 2I], interleaved the same way -> ``fc1_bias`` [E, 2I].
- ``mlp.experts.down_proj`` [E, I, hidden] -> ``fc2_weight``; ``down_proj_bias`` [E, hidden] ->
  ``fc2_bias``: copied.

Released checkpoints store ``gate_up_proj`` and ``down_proj`` as MXFP4 ``*_blocks`` / ``*_scales``
pairs: ``mxfp4.dequantize_gpt_oss_expert`` turns each pair into the dense tensor named here (the
biases are stored dense).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from backend.config.hf import GPT_OSS_FIELDS, gpt_oss_fields  # noqa: F401  (re-exported)

from .mxfp4 import dequantize_gpt_oss_expert
from .param_map import ParamMap, copy_in, copy_out, qkv_maps

#: The stacked per-expert HF tensors (``mlp.experts.<name>``); the first two may be MXFP4 pairs.
EXPERT_TENSORS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")


def deinterleave_gate_up(t: torch.Tensor) -> torch.Tensor:
    """[..., 2I] with gate/up interleaved -> [..., 2I] with all gate units, then all up units."""
    return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)


def interleave_gate_up(t: torch.Tensor) -> torch.Tensor:
    """Inverse of ``deinterleave_gate_up``."""
    gate, up = t.chunk(2, dim=-1)
    return torch.stack([gate, up], dim=-1).flatten(-2)


def _deinterleave_in(ts) -> torch.Tensor:
    return deinterleave_gate_up(ts[0]).contiguous()


def _interleave_out(t: torch.Tensor) -> list[torch.Tensor]:
    return [interleave_gate_up(t).contiguous()]


def gpt_oss_num_parameters(fields: dict) -> int:
    """Parameter count of the model ``fields`` describe (HF and megatron-core count the same tensors)."""
    h, n, g, d = fields["hidden_size"], fields["num_attention_heads"], fields["num_query_groups"], fields["head_dim"]
    e, i, v = fields["num_moe_experts"], fields["moe_ffn_hidden_size"], fields["vocab_size"]
    attn = (n + 2 * g) * d * (h + 1) + n * d * h + h + n  # qkv + biases, o_proj + bias, sinks
    moe = e * (h + 1) + e * (h * 2 * i + 2 * i + i * h + h)  # router, experts with biases
    per_layer = attn + moe + 2 * h  # two RMSNorms
    embeddings = v * h * (1 if fields["tie_embeddings"] else 2)
    return fields["num_layers"] * per_layer + embeddings + h


# ---- tensor mapping (import direction) ---------------------------------------------------------------


def gpt_oss_param_maps(fields: dict) -> list[ParamMap]:
    """Every megatron-core parameter of a GPT-OSS model with its HF sources (embedding, layers, norm, output).

    Our core attention holds each layer's sinks as ``self_attention.core_attention.softmax_offset``
    (megatron-core's name for a learnable softmax offset). Expert parameters are stacked like HF's
    (``grouped_experts``); their HF tensors may be MXFP4 pairs, read with ``read_expert_tensor``.
    """
    qkv_in, qkv_out = qkv_maps(fields)
    maps = [ParamMap("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), copy_in, copy_out)]
    for layer in range(fields["num_layers"]):
        m, h = f"decoder.layers.{layer}.", f"model.layers.{layer}."
        a = f"{h}self_attn."
        maps += [
            ParamMap(m + "input_layernorm.weight", (h + "input_layernorm.weight",), copy_in, copy_out),
            ParamMap(
                m + "self_attention.linear_qkv.weight", tuple(f"{a}{p}_proj.weight" for p in "qkv"), qkv_in, qkv_out
            ),
            ParamMap(m + "self_attention.linear_qkv.bias", tuple(f"{a}{p}_proj.bias" for p in "qkv"), qkv_in, qkv_out),
            ParamMap(m + "self_attention.linear_proj.weight", (a + "o_proj.weight",), copy_in, copy_out),
            ParamMap(m + "self_attention.linear_proj.bias", (a + "o_proj.bias",), copy_in, copy_out),
            ParamMap(m + "self_attention.core_attention.softmax_offset", (a + "sinks",), copy_in, copy_out),
            ParamMap(m + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",), copy_in, copy_out),
            ParamMap(m + "mlp.router.weight", (h + "mlp.router.weight",), copy_in, copy_out),
            ParamMap(m + "mlp.router.bias", (h + "mlp.router.bias",), copy_in, copy_out),
        ]
        x, ours = f"{h}mlp.experts.", f"{m}mlp.experts."
        maps += [
            ParamMap(ours + "fc1_weight", (x + "gate_up_proj",), _deinterleave_in, _interleave_out),
            ParamMap(ours + "fc1_bias", (x + "gate_up_proj_bias",), _deinterleave_in, _interleave_out),
            ParamMap(ours + "fc2_weight", (x + "down_proj",), copy_in, copy_out),
            ParamMap(ours + "fc2_bias", (x + "down_proj_bias",), copy_in, copy_out),
        ]
    maps.append(ParamMap("decoder.final_layernorm.weight", ("model.norm.weight",), copy_in, copy_out))
    if not fields["tie_embeddings"]:
        maps.append(ParamMap("output_layer.weight", ("lm_head.weight",), copy_in, copy_out))
    return maps


def read_expert_tensor(names: set[str], get: Callable[[str], torch.Tensor], name: str, dtype: torch.dtype):
    """A dense HF expert tensor by name: stored dense, or dequantised from its MXFP4 ``_blocks`` / ``_scales``.

    ``names`` is the checkpoint's tensor names, ``get`` reads one (e.g. ``HFCheckpoint.get``).
    """
    if name in names:
        return get(name).to(dtype)
    blocks, scales = f"{name}_blocks", f"{name}_scales"
    if blocks in names and scales in names:
        return dequantize_gpt_oss_expert(get(blocks), get(scales), dtype)
    raise KeyError(f"{name}: neither the tensor nor its MXFP4 pair ({blocks}, {scales}) is in the checkpoint")


#: The released 20B model's config values (openai/gpt-oss-20b config.json) and its parameter count.
GPT_OSS_20B = dict(
    num_hidden_layers=24,
    num_local_experts=32,
    num_experts_per_tok=4,
    vocab_size=201088,
    hidden_size=2880,
    intermediate_size=2880,
    head_dim=64,
    num_attention_heads=64,
    num_key_value_heads=8,
    sliding_window=128,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
)
GPT_OSS_20B_PARAMETERS = 20_914_757_184
