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

from backend.distributed.collectives import all_gather_objects
from backend.model.tensor_parallel import plain_name


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
