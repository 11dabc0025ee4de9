"""Checkpoints of a tensor-parallel model in the whole tensors' layout, so any TP size reads them.

FSDP2 shards each rank's TP slice as if it were the whole parameter: its DTensor says "global
shape [V / tp, H]", and both TP ranks of an FSDP2 coordinate would write different data under the
same name and offsets. Before a save, every split entry (the parameter and its optimizer moments)
is turned into this rank's FSDP2 chunk of the *whole* tensor: the TP slices gathered (one
all-gather over TP, one parameter at a time), the chunk cut locally. The TP ranks of a coordinate
then hold the same chunk and DCP writes it once (its save planner drops duplicate entries), at its
offset in the whole tensor: the files are those a TP 1 run writes, so TP 2 -> TP 1 (or any other
TP size) resumes by DCP's own resharding. A load runs the other way: whole-layout chunks are read,
gathered over FSDP2 (one parameter at a time) and each rank keeps its slice.

Cost: while a save or load runs, a rank holds whole-layout chunks of the split tensors, tp times
its slices' size (the parameters and both Adam moments), plus one whole tensor at a time.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from backend.distributed.fsdp import full_tensor
from backend.model.tensor_parallel import gather_slices, plain_name, slice_of_whole, tp_layout, whole_shape


def _split_entries(model, model_sd: dict, optim_sd: dict | None):
    layout = tp_layout(model)
    for name in list(model_sd):
        split = layout.splits.get(plain_name(name))
        if split is not None:
            yield model_sd, name, name, split
    for name, state in (optim_sd or {}).get("state", {}).items():
        split = layout.splits.get(plain_name(name))
        if split is None:
            continue
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                yield state, key, name, split


def to_whole_layout(model, model_sd: dict, optim_sd: dict | None = None, *, fill: bool):
    """(model state, optimizer state, swapped): copies of the state dicts' containers (the
    optimizer's own state dicts are never touched: ``get_state_dict`` hands out its live ones) in
    which each split entry is this rank's FSDP2 chunk of the whole tensor, with its values when
    ``fill`` (a save), storage only otherwise (a load fills it); ``swapped`` is what
    ``from_whole_layout`` needs to put the slices back. Unchanged without tensor parallelism."""
    layout = tp_layout(model)
    if layout.size == 1:
        return model_sd, optim_sd, []
    model_sd = dict(model_sd)
    if optim_sd is not None:
        optim_sd = {**optim_sd, "state": {k: dict(v) for k, v in optim_sd.get("state", {}).items()}}
    swapped = []
    for container, key, name, split in list(_split_entries(model, model_sd, optim_sd)):
        part = container[key]
        shape = whole_shape(model, name, part.shape)
        if fill:
            whole = gather_slices(full_tensor(part), *split, layout.group)
            chunk = distribute_tensor(whole, part.device_mesh, part.placements, src_data_rank=None)
            del whole
        else:
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            local_shape, _ = compute_local_shape_and_global_offset(shape, part.device_mesh, part.placements)
            chunk = DTensor.from_local(
                part.to_local().new_empty(local_shape),
                part.device_mesh,
                part.placements,
                run_check=False,
                shape=torch.Size(shape),
                stride=torch.empty(shape, device="meta").stride(),
            )
        container[key] = chunk
        swapped.append((container, key, split, part))
    return model_sd, optim_sd, swapped


@torch.no_grad()
def from_whole_layout(model, swapped: list) -> None:
    """After a load into ``to_whole_layout(..., fill=False)``'s chunks: each rank's TP slice
    copied into the original tensors (one whole tensor gathered over FSDP2 at a time)."""
    layout = tp_layout(model)
    rank = torch.distributed.get_rank(layout.group) if swapped else 0
    for container, key, split, part in swapped:
        whole = full_tensor(container[key])
        mine = slice_of_whole(whole, *split, rank, layout.size)
        local = distribute_tensor(mine, part.device_mesh, part.placements, src_data_rank=None)
        part.to_local().copy_(local.to_local())
        del whole, mine, local
