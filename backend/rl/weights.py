"""The policy's weights as a Hugging Face stream: ``(HF name, full tensor)`` pairs in lockstep.

vLLM's ``model.load_weights(weights)`` and SGLang's ``update_weights_from_tensor`` take exactly
this from a trainer: Hugging Face names (unfused, as ``save_pretrained`` writes them) and full,
unsharded tensors. Each FSDP2 parameter is gathered on its own (``full_tensor``: one all-gather
over the data-parallel ranks), converted (q/k/v split from megatron-core's fused QKV, gate/up from
fc1) and yielded, so a rank holds its shards plus at most one full parameter: for Qwen3-4B the
largest is the 0.78 GB FP32 embedding, never a second copy of the model. Every rank must iterate
the stream to the end, in the same order (the gathers are collectives).

The pairs come from the same conversion as ``tools/export_hf.py`` (``hf_tensors``), so at the same
weights and dtype they are bitwise the tensors of the exported safetensors files.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from backend.checkpoint.hf_export import full_named_tensors
from backend.model.hf.export import DTYPES, hf_tensors
from backend.model.lora import is_adapter, merge_stream
from backend.model.tensor_parallel import whole_shape


def export_dtype(dtype, model: torch.nn.Module) -> torch.dtype:
    """``dtype`` (None: the parameters' own, FP32 master weights here; a torch dtype or bf16 / fp32)."""
    if dtype is None:
        return next(model.parameters()).dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: allowed values are None, torch.float32, torch.bfloat16, 'fp32', 'bf16'")
    return DTYPES[dtype]


def _meta(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    model = getattr(model, "whole_meta", model)  # a pipeline stage: the whole model's entries
    for name, t in model.state_dict().items():
        if isinstance(t, torch.Tensor):  # a DTensor's shape is the global one (of a TP slice: whole_shape)
            t = torch.empty(whole_shape(model, name, t.shape), dtype=t.dtype, device="meta")
        yield name, t  # _extra_state entries (None) are dropped by hf_tensors


def weight_metadata(model: torch.nn.Module, fields: dict, dtype=None) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(HF name, dtype, shape) of every tensor ``hf_weights`` yields, in its order; no collective."""
    torch_dtype = export_dtype(dtype, model)
    named = merge_stream(model, _meta(model), fields)
    return [(n, t.dtype, tuple(t.shape)) for n, t in hf_tensors(named, fields, dtype=torch_dtype, device="meta")]


def hf_weights(
    model: torch.nn.Module, fields: dict, dtype=None, *, device: str | torch.device = "cpu", merged: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) one parameter at a time, on ``device``, cast to ``dtype``; with LoRA
    each targeted weight merged with its adapters (W + (alpha / r) B A: what the generators run),
    or with ``merged=False`` the base alone (an engine that applies the adapters itself)."""
    if merged:
        named = merge_stream(model, full_named_tensors(model), fields)
    else:
        named = full_named_tensors(model, keep=lambda name: not is_adapter(name))
    yield from hf_tensors(named, fields, dtype=export_dtype(dtype, model), device=device)


def adapter_weights(
    model: torch.nn.Module, *, device: str | torch.device = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """(whole-model name, full tensor) of every LoRA adapter parameter (only they are gathered)."""
    for name, t in full_named_tensors(model, keep=is_adapter):
        yield name, t.detach().to(device, torch.float32)
