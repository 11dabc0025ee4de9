"""Where a LoRA run's adapters start: new (A random from ``train.seed``, B 0: the model is the
base) or a PEFT adapter (``model.lora.adapter``), each parameter filled whole and then cut to
this rank's TP slice and FSDP2 shard, so the values do not depend on the layout."""

from __future__ import annotations

import torch

from .hf.peft import read_adapter
from .lora import init_adapters, is_adapter


@torch.no_grad()
def start_adapters(model: torch.nn.Module, cfg, stage=None) -> str:
    """Set every adapter of ``model``; returns what the start-up summary says of them."""
    lora = cfg.model.lora
    count = init_adapters(model, cfg.train.seed, stage=stage)
    if not lora.adapter:
        return f"LoRA rank {lora.rank} adapters on {', '.join(lora.target_modules)} (B = 0: the base's outputs)"
    from torch.distributed import get_rank

    from backend.errors import CheckpointError

    from .hf.load import fill_param
    from .tensor_parallel import plain_name, slice_of_whole, tp_layout, whole_shape

    tensors = read_adapter(lora.adapter, lora)
    layout = tp_layout(model)
    used = set()
    for name, param in model.named_parameters():
        local = plain_name(name)
        if not is_adapter(local):
            continue
        whole_name = local if stage is None else stage.source(local)
        if whole_name not in tensors:
            raise CheckpointError(f"model.lora.adapter={lora.adapter}: it has no tensor for {whole_name}")
        whole = tensors[whole_name]
        want = whole_shape(model, local, param.shape)
        if tuple(whole.shape) != tuple(want):
            raise CheckpointError(
                f"model.lora.adapter={lora.adapter}: {whole_name} has shape {tuple(whole.shape)}, the model's is {want}"
            )
        split = layout.splits.get(local)
        if split is not None:
            whole = slice_of_whole(whole, *split, get_rank(layout.group), layout.size)
        fill_param(param, whole.to(param.dtype))
        used.add(whole_name)
    if stage is None and (extra := sorted(set(tensors) - used)):
        raise CheckpointError(f"model.lora.adapter={lora.adapter}: tensors the model has no place for: {extra[:4]}")
    return f"LoRA rank {lora.rank} adapters ({count}) from {lora.adapter}"
