"""Where a LoRA run's adapters start: new (A random from ``train.seed``, B 0: the model is the
base) or a PEFT adapter (``model.lora.adapter``), each parameter filled whole and then cut to
this rank's TP slice and FSDP2 shard (``lora.fill_adapters``), so the values do not depend on the
layout."""

from __future__ import annotations

import torch

from backend.errors import CheckpointError

from .hf.peft import read_adapter
from .lora import fill_adapters, init_adapters


@torch.no_grad()
def start_adapters(model: torch.nn.Module, cfg, stage=None) -> str:
    """Set every adapter of ``model``; returns what the start-up summary says of them."""
    lora = cfg.model.lora
    if not lora.adapter:
        count = init_adapters(model, cfg.train.seed, stage=stage)
        return (
            f"LoRA rank {lora.rank} adapters ({count}) on {', '.join(lora.target_modules)} (B = 0: the base's outputs)"
        )
    tensors = read_adapter(lora.adapter, lora)

    def whole_of(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in tensors:
            raise CheckpointError(f"model.lora.adapter={lora.adapter}: it has no tensor for {name}")
        if tuple(tensors[name].shape) != tuple(shape):
            raise CheckpointError(
                f"model.lora.adapter={lora.adapter}: {name} has shape {tuple(tensors[name].shape)}, the model's is {shape}"
            )
        return tensors[name]

    used = fill_adapters(model, whole_of, stage=stage)
    if stage is None and (extra := sorted(set(tensors) - set(used))):
        raise CheckpointError(f"model.lora.adapter={lora.adapter}: tensors the model has no place for: {extra[:4]}")
    return f"LoRA rank {lora.rank} adapters ({len(used)}) from {lora.adapter}"
