"""Fill a built GPTModel's parameters from a HF checkpoint, one parameter at a time.

For each megatron-core parameter the mapping names its HF tensors; only those are read, combined
into the full parameter, cast to the parameter's dtype, and copied into it. A parameter that FSDP2
has sharded (a DTensor) takes its local shard from the full tensor with ``distribute_tensor(...,
src_data_rank=None)``: every rank reads the same file and keeps its own slice, with no
communication. Peak extra host memory is one full parameter (plus its HF parts).

Checks, before and after: every needed tensor exists (before anything is read), every shape
matches the model's, and no tensor of the checkpoint is left unused (except the documented
ignorable buffers), so a mismatched checkpoint fails loudly instead of half-loading.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .mapping import hf_to_megatron_names, ignorable_hf_names
from .safetensors_io import HFCheckpoint


def _strip(name: str) -> str:
    """Parameter names as the mapping knows them, whatever wrapper prefixes the model carries."""
    for prefix in ("module.", "_orig_mod.", "_checkpoint_wrapped_module."):
        name = name.replace(prefix, "")
    return name


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, hf_dir: str | Path, fields: dict) -> int:
    """Copy the checkpoint's weights into ``model``; returns the number of parameters filled."""
    params = {_strip(n): p for n, p in model.named_parameters()}
    maps = hf_to_megatron_names(fields)
    wanted = {pm.megatron for pm in maps}
    absent = sorted(wanted - set(params))
    extra = sorted(set(params) - wanted)
    if absent or extra:
        raise ValueError(
            f"model and mapping disagree: missing in model {absent[:5]}, not in mapping {extra[:5]} "
            "(was it built from the same fields?)"
        )
    with HFCheckpoint(hf_dir) as ckpt:
        ckpt.check_present(n for pm in maps for n in pm.hf)
        for pm in maps:
            full = pm.to_megatron(ckpt.get_many(pm.hf))
            param = params[pm.megatron]
            if tuple(full.shape) != tuple(param.shape):
                raise ValueError(
                    f"{pm.megatron}: checkpoint gives shape {tuple(full.shape)} (from {', '.join(pm.hf)}), "
                    f"the model has {tuple(param.shape)}"
                )
            full = full.to(param.dtype)
            if hasattr(param, "device_mesh") and hasattr(param, "placements"):  # an FSDP2 DTensor
                from torch.distributed.tensor import distribute_tensor

                local = distribute_tensor(
                    full.to(param.device), param.device_mesh, param.placements, src_data_rank=None
                ).to_local()
                param.to_local().copy_(local)
            else:
                param.copy_(full)
            del full
        ckpt.check_consumed(ignorable_hf_names(fields))
    return len(maps)
