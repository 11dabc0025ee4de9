"""Parameter names and tensor layouts: Hugging Face <-> megatron-core GPTModel (local layer spec).

One ``ParamMap`` per megatron-core parameter says which HF tensors it is made of and how, so a
loader can read just those tensors, build one full parameter, hand it to its (FSDP) shard and
drop it: peak host memory is one parameter (a 4B model's largest, the embedding, is 0.78 GB in
FP32), never the whole model.

Layouts (full, unsharded tensors; ``h`` = head_dim, ``n`` = query heads, ``g`` = query groups):

- ``self_attention.linear_qkv.weight`` is [(n + 2g) * h, hidden], grouped per query group as
  megatron-core splits it: for each group, its n/g query heads, then its key head, then its
  value head. HF keeps q_proj [n*h, hidden], k_proj [g*h, hidden], v_proj [g*h, hidden]
  separately; query head j belongs to group j // (n/g) in both. The bias (Qwen2) is the same
  layout without the last axis.
- ``mlp.linear_fc1.weight`` is cat([gate_proj, up_proj]) along rows: megatron-core's SwiGLU
  computes silu(first half) * second half.
- With the local spec the norms are separate modules: ``input_layernorm.weight``,
  ``pre_mlp_layernorm.weight`` and (Qwen3) ``self_attention.q_layernorm.weight`` /
  ``k_layernorm.weight`` of size head_dim, shared by all heads as in HF.
- ``output_layer.weight`` exists only untied; tied, the output reuses the embedding.

The vocabulary is not padded: embedding and output rows are exactly ``vocab_size`` (see config).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import torch

from .gpt_oss import gpt_oss_param_maps
from .param_map import ParamMap, copy_in, copy_out, qkv_maps

#: HF tensors that may sit in a checkpoint without being weights we load (buffers some
#: exporters save). Matched with ``re.fullmatch``.
IGNORABLE_HF_PATTERNS = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq", r"model\.rotary_emb\.inv_freq")


def _fc1_in(ts: Sequence[torch.Tensor]) -> torch.Tensor:
    gate, up = ts
    if gate.shape != up.shape:
        raise ValueError(f"gate_proj {tuple(gate.shape)} and up_proj {tuple(up.shape)} differ in shape")
    return torch.cat([gate, up], dim=0)


def _fc1_out(t: torch.Tensor) -> list[torch.Tensor]:
    gate, up = t.chunk(2, dim=0)
    return [gate.contiguous(), up.contiguous()]


def _layer_entries(fields: dict) -> list[tuple[str, tuple[str, ...], Callable, Callable]]:
    """(megatron suffix, HF suffixes, to_megatron, to_hf) for one decoder layer."""
    qkv_in, qkv_out = qkv_maps(fields)
    attn = "self_attn."
    entries = [
        ("input_layernorm.weight", ("input_layernorm.weight",), copy_in, copy_out),
        (
            "self_attention.linear_qkv.weight",
            tuple(f"{attn}{p}_proj.weight" for p in "qkv"),
            qkv_in,
            qkv_out,
        ),
        ("self_attention.linear_proj.weight", (f"{attn}o_proj.weight",), copy_in, copy_out),
        ("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), copy_in, copy_out),
        ("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), _fc1_in, _fc1_out),
        ("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), copy_in, copy_out),
    ]
    if fields["qkv_bias"]:
        entries.insert(
            2, ("self_attention.linear_qkv.bias", tuple(f"{attn}{p}_proj.bias" for p in "qkv"), qkv_in, qkv_out)
        )
    if fields["qk_layernorm"]:
        entries += [
            ("self_attention.q_layernorm.weight", (f"{attn}q_norm.weight",), copy_in, copy_out),
            ("self_attention.k_layernorm.weight", (f"{attn}k_norm.weight",), copy_in, copy_out),
        ]
    return entries


#: A critic's scalar head (``model.head: value``), as transformers' ``*ForTokenClassification``
#: names it (one label): our output_layer.weight [1, hidden] and its bias.
VALUE_HEAD = {"output_layer.weight": "score.weight", "output_layer.bias": "score.bias"}


def _top_entries(fields: dict) -> list[tuple[str, tuple[str, ...], Callable, Callable]]:
    entries = [
        ("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), copy_in, copy_out),
        ("decoder.final_layernorm.weight", ("model.norm.weight",), copy_in, copy_out),
    ]
    if fields.get("head") == "value":
        entries += [(ours, (theirs,), copy_in, copy_out) for ours, theirs in VALUE_HEAD.items()]
    elif not fields["tie_embeddings"]:
        entries.append(("output_layer.weight", ("lm_head.weight",), copy_in, copy_out))
    return entries


def hf_to_megatron_names(fields: dict) -> list[ParamMap]:
    """Every megatron-core parameter of the model ``fields`` describes, with its HF sources.

    Order: embedding, layers 0..L-1 (each in module order), final norm, output layer. A loader
    reads ``pm.hf`` (e.g. with ``safetensors_io.HFCheckpoint.get``) and calls ``pm.to_megatron``.
    """
    if fields.get("model_type") == "gpt_oss":
        return gpt_oss_param_maps(fields)
    top = {m: (h, i, o) for m, h, i, o in _top_entries(fields)}
    maps = [ParamMap("embedding.word_embeddings.weight", *top.pop("embedding.word_embeddings.weight"))]
    for layer in range(fields["num_layers"]):
        for m, h, i, o in _layer_entries(fields):
            maps.append(ParamMap(f"decoder.layers.{layer}.{m}", tuple(f"model.layers.{layer}.{x}" for x in h), i, o))
    maps += [ParamMap(m, *rest) for m, rest in top.items()]
    return maps


_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")


def megatron_to_hf(name: str, tensor: torch.Tensor, fields: dict) -> list[tuple[str, torch.Tensor]]:
    """The HF (name, tensor) pairs one full megatron-core parameter becomes, for export.

    ``_extra_state`` entries (megatron-core's FP8 bookkeeping, None here) map to nothing; any
    other unknown name is an error naming it.
    """
    if name.endswith("._extra_state"):
        return []
    match = _LAYER.fullmatch(name)
    if match:
        layer, suffix = int(match.group(1)), match.group(2)
        if layer >= fields["num_layers"]:
            raise KeyError(f"{name}: layer {layer} is beyond num_layers={fields['num_layers']}")
        entries, prefix = _layer_entries(fields), f"model.layers.{layer}."
    else:
        suffix, entries, prefix = name, _top_entries(fields), ""
    for m, hf_names, _, to_hf in entries:
        if m == suffix:
            return [(prefix + h, t) for h, t in zip(hf_names, to_hf(tensor), strict=True)]
    raise KeyError(f"{name}: no Hugging Face counterpart for this megatron-core parameter")


def ignorable_hf_names(fields: dict) -> tuple[str, ...]:
    """Regex patterns of HF tensors a checkpoint may hold that import does not need.

    Tied checkpoints sometimes also store ``lm_head.weight`` (a copy of the embedding); the tied
    model has no output weight of its own, so it is skipped.
    """
    unused_lm_head = fields["tie_embeddings"] or fields.get("head") == "value"  # a critic from a causal LM
    return IGNORABLE_HF_PATTERNS + ((r"lm_head\.weight",) if unused_lm_head else ())
