"""Checkpoints of a pipeline stage in the whole model's layout, so any pipeline size reads them.

Each stage's state dicts name its parameters as the stage knows them (``decoder.layers.0`` of the
second stage is the whole model's layer ``first``); before DCP sees them they are renamed to the
whole model's names (``pipeline_stage.StageNames``), so the stages together write exactly the keys
a run without pipelining writes, and a checkpoint resumes at another pipeline size through DCP's
own key lookup. The last stage's copy of a tied embedding is not written (the whole model has one
tensor); on a load it is read from the embedding's entries, weights and Adam moments alike.

The optimizer's ``param_groups`` name their parameters too, and differ between stages, while DCP
keeps one copy of a non-tensor entry: on a save every stage writes the same groups, listing every
stage's parameters (one small all-gather over the pipeline group), which a run without pipelining
loads as its own; a pipelined load reads the optimizer's state only and keeps its own groups (its
hyperparameters are the run's config anyway: ``resume.apply_optimizer_config``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from backend.distributed.collectives import all_gather_objects, broadcast_tensor
from backend.model.pipeline_stage import StageNames
from backend.model.tensor_parallel import plain_name, whole_shape


def to_whole_names(model, model_sd: dict, optim_sd: dict | None = None, *, env=None, saving: bool):
    """(model state, optimizer state) keyed by the whole model's names (containers copied, tensors
    shared); unchanged without pipelining. ``saving``: the tied copy left out and the optimizer's
    groups listing every stage's parameters (needs ``env``); a load maps the tied copy to the
    embedding's entries and drops the groups."""
    names = getattr(model, "stage_names", None)
    if names is None:
        return model_sd, optim_sd
    rename = names.whole if saving else names.source

    def keyed(entries: dict) -> dict:
        out = {}
        for key, value in entries.items():
            whole = rename(plain_name(key))
            if whole is not None:
                out[whole] = value
        return out

    model_sd = keyed(model_sd)
    if optim_sd is not None:
        renamed = {"state": keyed(optim_sd.get("state", {}))}
        if saving:
            groups = []
            for group in optim_sd.get("param_groups", []):
                mine = [w for w in (rename(plain_name(p)) for p in group["params"]) if w is not None]
                every = all_gather_objects(mine, group=env.group("pp"))
                groups.append({**group, "params": [name for part in every for name in part]})
            renamed["param_groups"] = groups
        optim_sd = renamed
    return model_sd, optim_sd


def whole_model_tensors(model, full, keep=None) -> Iterator[tuple[str, torch.Tensor]]:
    """(whole model's name, full tensor) of every parameter of every stage, in the whole model's
    order, on every rank of the pipeline: the RL weight stream and ``generate`` under pipeline
    parallelism, each stage streaming its own layers. ``full(local name, tensor)`` gathers a stage
    parameter whole (FSDP2 over the stage's dp x cp, then its TP slices: collectives inside the
    stage); the owning stage then broadcasts it over the pipeline group, so every rank yields the
    same pairs as a run without pipelining (``model.whole_meta``: the whole model's names, shapes
    and dtypes, on the meta device). One full tensor is held at a time, as without pipelining.
    The last stage's tied copy is never sent (the embedding, from the first stage, is the tensor)."""
    names = model.stage_names
    whole = model.whole_meta
    ranks = model.stage_ranks
    mine = {names.whole(plain_name(k)): (k, t) for k, t in model.state_dict().items() if isinstance(t, torch.Tensor)}
    owners = [StageNames(s, names.stages, *model.stage_splits[s], names.tied) for s in range(names.stages)]
    device = next(model.parameters()).device
    for name, meta in whole.state_dict().items():
        if not isinstance(meta, torch.Tensor) or name.endswith("._extra_state") or (keep and not keep(name)):
            continue
        owner = next(s for s, o in enumerate(owners) if o.local(name) is not None and o.local(name) != o.tied_copy)
        shape = whole_shape(whole, name, meta.shape)
        if owner == names.stage:
            key, tensor = mine[name]
            tensor = full(key, tensor).to(meta.dtype).contiguous()
        else:
            tensor = torch.empty(shape, dtype=meta.dtype, device=device)
        yield name, broadcast_tensor(tensor, src=ranks[owner], group=model.pipeline_group)
