"""GPT-OSS (``model_type: gpt_oss``) <-> megatron-core GPTModel: the MoE MLP's tensor layouts.

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

import torch


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
