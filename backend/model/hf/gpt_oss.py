"""GPT-OSS (``model_type: gpt_oss``) <-> megatron-core GPTModel: config fields and tensor layouts.

``gpt_oss_fields`` reads a config.json dict (the base fields of ``config.FIELDS`` plus GPT-OSS's:
attention biases, sinks, per-layer sliding windows, experts); ``gpt_oss_param_maps`` lists every
megatron-core parameter with its HF sources (import direction; experts are slices of stacked HF
tensors, so export goes through ``stack_experts_to_hf``). The MoE MLP's layouts:

Transformers' ``GptOssMLP`` = ``router`` (``GptOssTopKRouter``) + ``experts`` (``GptOssExperts``):

- ``mlp.router.weight`` [E, hidden], ``mlp.router.bias`` [E] -> megatron-core ``mlp.router.weight`` /
  ``mlp.router.bias``, copied (top-k over logits + bias, softmax over the k: see ``moe_compat``).
- ``mlp.experts.gate_up_proj`` [E, hidden, 2I] is *in-major* (``x @ W``) and *interleaved*: column
  2i is gate unit i, column 2i + 1 is up unit i. megatron-core's expert ``linear_fc1.weight`` is
  [2I, hidden] (out-major) with all gate rows first, then all up rows (its GLU chunks the output
  in two). So expert e: ``fc1 = cat([W[e][:, 0::2].T, W[e][:, 1::2].T])``.
- ``mlp.experts.gate_up_proj_bias`` [E, 2I], interleaved the same way -> ``linear_fc1.bias`` [2I]
  = ``cat([b[e][0::2], b[e][1::2]])``.
- ``mlp.experts.down_proj`` [E, I, hidden] (in-major) -> ``linear_fc2.weight`` [hidden, I] = ``W[e].T``;
  ``mlp.experts.down_proj_bias`` [E, hidden] -> ``linear_fc2.bias`` = ``b[e]``.

megatron-core names expert e of layer L ``decoder.layers.L.mlp.experts.local_experts.e.linear_fc{1,2}``
(``SequentialMLP``, expert parallel size 1). Released checkpoints store ``gate_up_proj`` and
``down_proj`` as MXFP4 ``*_blocks`` / ``*_scales`` pairs: ``mxfp4.dequantize_gpt_oss_expert`` turns
each pair into the dense tensor named here (the biases are stored dense).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from backend.config.hf import GPT_OSS_FIELDS, gpt_oss_fields  # noqa: F401  (re-exported)

from .mapping import ParamMap, _copy_in, _copy_out, _qkv_maps
from .mxfp4 import dequantize_gpt_oss_expert

#: The stacked per-expert HF tensors (``mlp.experts.<name>``); the first two may be MXFP4 pairs.
EXPERT_TENSORS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")


def _check(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape}")


def deinterleave_gate_up(t: torch.Tensor) -> torch.Tensor:
    """[..., 2I] with gate/up interleaved -> [..., 2I] with all gate units, then all up units."""
    return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)


def interleave_gate_up(t: torch.Tensor) -> torch.Tensor:
    """Inverse of ``deinterleave_gate_up``."""
    gate, up = t.chunk(2, dim=-1)
    return torch.stack([gate, up], dim=-1).flatten(-2)


def expert_fc1_weight(gate_up_proj: torch.Tensor, expert: int) -> torch.Tensor:
    """megatron-core ``linear_fc1.weight`` [2I, hidden] of one expert from HF ``gate_up_proj`` [E, hidden, 2I]."""
    return deinterleave_gate_up(gate_up_proj[expert]).t().contiguous()


def expert_fc1_bias(gate_up_proj_bias: torch.Tensor, expert: int) -> torch.Tensor:
    """megatron-core ``linear_fc1.bias`` [2I] of one expert from HF ``gate_up_proj_bias`` [E, 2I]."""
    return deinterleave_gate_up(gate_up_proj_bias[expert]).contiguous()


def expert_fc2_weight(down_proj: torch.Tensor, expert: int) -> torch.Tensor:
    """megatron-core ``linear_fc2.weight`` [hidden, I] of one expert from HF ``down_proj`` [E, I, hidden]."""
    return down_proj[expert].t().contiguous()


def expert_fc2_bias(down_proj_bias: torch.Tensor, expert: int) -> torch.Tensor:
    return down_proj_bias[expert].contiguous()


def stack_experts_to_hf(fc1_w, fc1_b, fc2_w, fc2_b) -> dict[str, torch.Tensor]:
    """Export: lists of per-expert megatron-core tensors (expert order) -> HF's four stacked tensors."""
    return {
        "gate_up_proj": torch.stack([interleave_gate_up(w.t()) for w in fc1_w]).contiguous(),
        "gate_up_proj_bias": torch.stack([interleave_gate_up(b) for b in fc1_b]).contiguous(),
        "down_proj": torch.stack([w.t() for w in fc2_w]).contiguous(),
        "down_proj_bias": torch.stack(list(fc2_b)).contiguous(),
    }


@torch.no_grad()
def load_moe_mlp(megatron_mlp, hf_tensors: dict[str, torch.Tensor]) -> None:
    """Copy one layer's HF MoE MLP (keys ``router.weight``, ``router.bias``, ``experts.gate_up_proj``,
    ``experts.gate_up_proj_bias``, ``experts.down_proj``, ``experts.down_proj_bias``) into a
    megatron-core ``MoELayer`` with ``SequentialMLP`` experts (all experts local)."""
    experts = megatron_mlp.experts.local_experts
    n, hidden = megatron_mlp.router.weight.shape
    inter = experts[0].linear_fc2.weight.shape[1]
    _check("router.weight", hf_tensors["router.weight"], (n, hidden))
    _check("experts.gate_up_proj", hf_tensors["experts.gate_up_proj"], (n, hidden, 2 * inter))
    _check("experts.down_proj", hf_tensors["experts.down_proj"], (n, inter, hidden))
    megatron_mlp.router.weight.copy_(hf_tensors["router.weight"])
    megatron_mlp.router.bias.copy_(hf_tensors["router.bias"])
    for e, expert in enumerate(experts):
        expert.linear_fc1.weight.copy_(expert_fc1_weight(hf_tensors["experts.gate_up_proj"], e))
        expert.linear_fc1.bias.copy_(expert_fc1_bias(hf_tensors["experts.gate_up_proj_bias"], e))
        expert.linear_fc2.weight.copy_(expert_fc2_weight(hf_tensors["experts.down_proj"], e))
        expert.linear_fc2.bias.copy_(expert_fc2_bias(hf_tensors["experts.down_proj_bias"], e))


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


def _expert_entry(fn: Callable, expert: int) -> Callable:
    def to_megatron(ts):
        return fn(ts[0], expert)

    return to_megatron


def _no_single_export(t):
    raise NotImplementedError("expert tensors are stacked in HF checkpoints: export with stack_experts_to_hf")


def gpt_oss_param_maps(fields: dict) -> list[ParamMap]:
    """Every megatron-core parameter of a GPT-OSS model with its HF sources (embedding, layers, norm, output).

    Our core attention holds each layer's sinks as ``self_attention.core_attention.softmax_offset``
    (megatron-core's name for a learnable softmax offset). Expert parameters read a slice of one
    stacked HF tensor: a loader should keep the stacked tensor (dequantised once when the checkpoint
    holds ``*_blocks`` / ``*_scales``, see ``read_expert_tensor``) while it fills a layer's experts.
    """
    qkv_in, qkv_out = _qkv_maps(fields)
    maps = [ParamMap("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), _copy_in, _copy_out)]
    for layer in range(fields["num_layers"]):
        m, h = f"decoder.layers.{layer}.", f"model.layers.{layer}."
        a = f"{h}self_attn."
        maps += [
            ParamMap(m + "input_layernorm.weight", (h + "input_layernorm.weight",), _copy_in, _copy_out),
            ParamMap(
                m + "self_attention.linear_qkv.weight", tuple(f"{a}{p}_proj.weight" for p in "qkv"), qkv_in, qkv_out
            ),
            ParamMap(m + "self_attention.linear_qkv.bias", tuple(f"{a}{p}_proj.bias" for p in "qkv"), qkv_in, qkv_out),
            ParamMap(m + "self_attention.linear_proj.weight", (a + "o_proj.weight",), _copy_in, _copy_out),
            ParamMap(m + "self_attention.linear_proj.bias", (a + "o_proj.bias",), _copy_in, _copy_out),
            ParamMap(m + "self_attention.core_attention.softmax_offset", (a + "sinks",), _copy_in, _copy_out),
            ParamMap(m + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",), _copy_in, _copy_out),
            ParamMap(m + "mlp.router.weight", (h + "mlp.router.weight",), _copy_in, _copy_out),
            ParamMap(m + "mlp.router.bias", (h + "mlp.router.bias",), _copy_in, _copy_out),
        ]
        x = f"{h}mlp.experts."
        for e in range(fields["num_moe_experts"]):
            pre = f"{m}mlp.experts.local_experts.{e}."
            maps += [
                ParamMap(
                    pre + "linear_fc1.weight",
                    (x + "gate_up_proj",),
                    _expert_entry(expert_fc1_weight, e),
                    _no_single_export,
                ),
                ParamMap(
                    pre + "linear_fc1.bias",
                    (x + "gate_up_proj_bias",),
                    _expert_entry(expert_fc1_bias, e),
                    _no_single_export,
                ),
                ParamMap(
                    pre + "linear_fc2.weight",
                    (x + "down_proj",),
                    _expert_entry(expert_fc2_weight, e),
                    _no_single_export,
                ),
                ParamMap(
                    pre + "linear_fc2.bias",
                    (x + "down_proj_bias",),
                    _expert_entry(expert_fc2_bias, e),
                    _no_single_export,
                ),
            ]
    maps.append(ParamMap("decoder.final_layernorm.weight", ("model.norm.weight",), _copy_in, _copy_out))
    if not fields["tie_embeddings"]:
        maps.append(ParamMap("output_layer.weight", ("lm_head.weight",), _copy_in, _copy_out))
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
