"""A pipeline stage's model: which of the whole model's parameters it holds, under which names.

A stage is megatron-core's GPTModel built with its decoder layers only (the builder's ``stage``):
layer ``first + i`` of the whole model is the stage's ``decoder.layers.i``; the embedding lives on
the first stage, the final norm and the output layer on the last. ``StageNames`` maps names both
ways, so everything outside the model speaks the whole model's names: checkpoints (saved and
resumed in the whole-model layout, at any pipeline size), Hugging Face import (a stage reads only
its own tensors) and export, the RL weight stream.

Tied embeddings (Qwen3-0.6B to 4B): the last stage holds its own output weight, a copy of the
first stage's embedding. It starts equal (copied from the whole model, or read from the
embedding's tensor in a checkpoint or a Hugging Face directory), and stays equal: every step the
two gradients are summed over the two stages (``sum_tied_grads``) before identical optimizer
updates. On disk and in the weight stream it is never written (the whole model has one tensor).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"
_LAYER = re.compile(r"^(decoder\.layers\.)(\d+)(\..*)$")


@dataclass(frozen=True)
class StageNames:
    """Name maps of stage ``stage`` of ``stages`` holding layers ``first .. first + count - 1``."""

    stage: int
    stages: int
    first: int
    count: int
    tied: bool  # the model ties its output layer to the embedding

    @property
    def pre(self) -> bool:
        return self.stage == 0

    @property
    def post(self) -> bool:
        return self.stage == self.stages - 1

    @property
    def tied_copy(self) -> str | None:
        """The local name of the last stage's copy of the tied embedding (None: no such copy)."""
        return OUTPUT if self.tied and self.post and not self.pre else None

    def local(self, name: str) -> str | None:
        """The stage's name for the whole model's parameter ``name`` (None: not on this stage);
        the embedding also answers for the last stage's tied copy."""
        match = _LAYER.match(name)
        if match:
            i = int(match.group(2))
            return (
                f"{match.group(1)}{i - self.first}{match.group(3)}"
                if self.first <= i < self.first + self.count
                else None
            )
        if name.startswith("embedding."):
            if self.pre:
                return name
            return OUTPUT if name == EMBEDDING and self.tied_copy else None
        if name.startswith(("decoder.final_layernorm", "output_layer")):
            return name if self.post else None
        return name  # anything else (none today) lives on every stage

    def whole(self, local: str) -> str | None:
        """The whole model's name of the stage's parameter ``local`` (None: the tied copy, which
        the whole model does not have)."""
        if local == self.tied_copy:
            return None
        match = _LAYER.match(local)
        if match:
            return f"{match.group(1)}{int(match.group(2)) + self.first}{match.group(3)}"
        return local

    def source(self, local: str) -> str:
        """The whole model's tensor the stage's ``local`` parameter is filled from."""
        return EMBEDDING if local == self.tied_copy else self.whole(local)


def stage_names(model_cfg, env) -> StageNames:
    """This rank's ``StageNames`` (``env.dims``' split of ``model.num_layers``)."""
    from .fields import is_value_head

    first, count = env.dims.stage_range(env.pp_rank, model_cfg.num_layers)
    tied = bool(model_cfg.tie_embeddings and not is_value_head(model_cfg))
    return StageNames(env.pp_rank, env.dims.pp, first, count, tied)


def copy_from_whole(stage: torch.nn.Module, whole: torch.nn.Module, names: StageNames) -> None:
    """Fill every parameter of ``stage`` from ``whole`` (both plain, unsharded modules): a stage
    then starts from exactly the weights the whole model of the same seed has."""
    source = dict(whole.named_parameters())
    with torch.no_grad():
        for local, param in stage.named_parameters():
            param.copy_(source[names.source(local)])
