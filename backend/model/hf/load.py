"""Fill a built GPTModel's parameters from a HF checkpoint, one parameter at a time.

For each megatron-core parameter the mapping names its HF tensors; only those are read, combined
into the full parameter, cast to the parameter's dtype, and copied into it. A parameter that FSDP2
has sharded (a DTensor) takes its local shard from the full tensor with ``distribute_tensor(...,
src_data_rank=None)``: every rank reads the same file and keeps its own slice, with no
communication. A parameter copied from one HF tensor (embedding, output layer, o_proj, down_proj,
norms) is read as just this rank's rows; only the fused ones (QKV, gate+up) are assembled in full,
so the peak extra host memory is one fused layer parameter, not the 0.62 GB FP32 embedding of a
0.5B Qwen3 (measured with tools/bench/bench_hf_load.py). GPT-OSS's stacked experts ([E, ...], FSDP2
shards E) are read as this rank's experts only, MXFP4 pairs sliced before they are dequantised.

Checks, before and after: every needed tensor exists (before anything is read), every shape
matches the model's, and no tensor of the checkpoint is left unused (except the documented
ignorable buffers), so a mismatched checkpoint fails loudly instead of half-loading.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from ..tensor_parallel import plain_name, slice_of_whole, tp_layout, whole_shape
from .gpt_oss import EXPERT_TENSORS, read_expert_tensor
from .mapping import hf_to_megatron_names, ignorable_hf_names
from .safetensors_io import HFCheckpoint


class _ExpertReader:
    """GPT-OSS stacked expert tensors ([E, ...], one per projection and layer, each read once),
    dense or as MXFP4 ``_blocks`` / ``_scales`` pairs dequantised to the model's dtype on read."""

    def __init__(self, ckpt: HFCheckpoint, dtype: torch.dtype):
        self.ckpt, self.dtype = ckpt, dtype
        self.names = set(ckpt.names())

    @staticmethod
    def is_expert(name: str) -> bool:
        return name.rsplit(".", 1)[-1] in EXPERT_TENSORS and ".mlp.experts." in name

    def needed(self, name: str) -> list[str]:
        if name in self.names:
            return [name]
        return [f"{name}_blocks", f"{name}_scales"]

    def experts(self, name: str) -> int:
        """E, from the stored header (the dense tensor's or its MXFP4 blocks')."""
        return self.ckpt.shape(self.needed(name)[0])[0]

    def get(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The dense tensor, or only experts [start, stop) (an FSDP2 shard): the MXFP4 pair is
        sliced before dequantising, so a rank holds 1/world of GPT-OSS-20B's 2.1 GB FP32 gate_up."""
        read = self.ckpt.get if rows is None else (lambda n: self.ckpt.get_rows(n, *rows))
        return read_expert_tensor(self.names, read, name, self.dtype)


_strip = plain_name  # parameter names as the mapping knows them, whatever wrapper prefixes the model carries


def _is_dtensor(param) -> bool:
    return hasattr(param, "device_mesh") and hasattr(param, "placements")


def _contiguous_rows(param) -> bool:
    """A _StridedShard(0, split_factor=f) is one block of rows only when f is the number of shards
    the later mesh dimensions cut dim 0 into (FSDP2 over expert_dp inside the EP shard); any other
    layout is read whole and sliced (``fill_param``), never misplaced."""
    mesh, placements = param.device_mesh, param.placements
    for i, p in enumerate(placements):
        factor = getattr(p, "split_factor", None)
        if factor is None:
            continue
        later = 1
        for j in range(i + 1, len(placements)):
            if not placements[j].is_replicate():
                later *= mesh.size(j)
        if factor != later:
            return False
    return True


def _local_rows(param) -> tuple[int, int] | None:
    """(start, stop) rows of this rank's shard when the parameter is sharded on dim 0 only."""

    if not _is_dtensor(param):
        return None
    # FSDP2's Shard(0), or its _StridedShard(0) over experts already split by expert parallelism
    # (both keep a contiguous block of rows; compute_local_shape_and_global_offset knows where).
    if any(p.is_partial() or (not p.is_replicate() and getattr(p, "dim", None) != 0) for p in param.placements):
        return None
    if not _contiguous_rows(param):
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    if any(o for o in offset[1:]) or tuple(shape[1:]) != tuple(param.shape[1:]):
        return None
    return offset[0], offset[0] + shape[0]


def _check_shape(pm, shape: tuple, param, expected: tuple | None = None) -> None:
    expected = tuple(param.shape) if expected is None else tuple(expected)
    if shape != expected:
        raise ValueError(
            f"{pm.megatron}: checkpoint gives shape {shape} (from {', '.join(pm.hf)}), the model has {expected}"
        )


def fill_param(param, full: torch.Tensor) -> None:
    """Copy a full tensor into a parameter, or this rank's shard of it (no communication)."""
    if _is_dtensor(param):
        from torch.distributed.tensor import distribute_tensor

        local = distribute_tensor(full.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(local.to_local())
    else:
        param.copy_(full)


def has_value_head(hf_dir: str | Path) -> bool:
    """Whether the checkpoint holds a token-classification head (``score.weight``): a critic."""
    with HFCheckpoint(hf_dir) as ckpt:
        return "score.weight" in set(ckpt.names())


@torch.no_grad()
def init_value_head(model: torch.nn.Module, *, std: float, seed: int) -> None:
    """A critic's head for a model imported from a causal LM (no ``score`` in the checkpoint):
    weight ~ N(0, std) from ``seed`` (the same on every rank, each keeping its shard), bias 0."""
    params = {_strip(n): p for n, p in model.named_parameters()}
    weight, bias = params["output_layer.weight"], params["output_layer.bias"]
    g = torch.Generator().manual_seed(seed)
    fill_param(weight, (torch.randn(tuple(weight.shape), generator=g) * std).to(weight.dtype))
    fill_param(bias, torch.zeros(tuple(bias.shape), dtype=bias.dtype))


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, hf_dir: str | Path, fields: dict, *, skip=(), stage=None) -> int:
    """Copy the checkpoint's weights into ``model``; returns the number of parameters filled.
    ``skip``: parameters the caller fills itself (a critic's head imported from a causal LM).
    ``stage`` (``pipeline_stage.StageNames``): ``model`` is one pipeline stage; only its own
    tensors are read (a tied output copy from the embedding's), the rest of the file is left."""
    local_of = {}  # whole-model name -> the model's own name
    for n, _ in model.named_parameters():
        local_of[_strip(n) if stage is None else stage.source(_strip(n))] = _strip(n)
    by_local = {_strip(n): p for n, p in model.named_parameters()}
    params = {w: by_local[n] for w, n in local_of.items() if n not in set(skip)}
    maps = hf_to_megatron_names(fields)
    if stage is not None:
        maps = [pm for pm in maps if pm.megatron in params]
    wanted = {pm.megatron for pm in maps}
    absent = sorted(wanted - set(params))
    extra = sorted(set(params) - wanted)
    if absent or extra:
        raise ValueError(
            f"model and mapping disagree: missing in model {absent[:5]}, not in mapping {extra[:5]} "
            "(was it built from the same fields?)"
        )
    with HFCheckpoint(hf_dir) as ckpt:
        experts = _ExpertReader(ckpt, next(iter(params.values())).dtype)
        ckpt.check_present(
            x for pm in maps for n in pm.hf for x in (experts.needed(n) if experts.is_expert(n) else [n])
        )
        layout = tp_layout(model)
        for pm in maps:
            param = params[pm.megatron]
            split = layout.splits.get(local_of[pm.megatron])
            rows = _local_rows(param) if split == (0, 1) and pm.is_copy else None
            if rows is not None:  # a vocabulary slice (embedding, output layer): only its FSDP2 rows read
                _check_shape(
                    pm, tuple(ckpt.shape(pm.hf[0])), param, whole_shape(model, local_of[pm.megatron], param.shape)
                )
                offset = dist.get_rank(layout.group) * param.shape[0]
                param.to_local().copy_(ckpt.get_rows(pm.hf[0], rows[0] + offset, rows[1] + offset).to(param.dtype))
                continue
            if split is not None:  # another tensor-parallel slice: the whole tensor read, this rank's slice kept
                full = pm.to_megatron(ckpt.get_many(pm.hf))
                _check_shape(pm, tuple(full.shape), param, whole_shape(model, local_of[pm.megatron], param.shape))
                fill_param(
                    param, slice_of_whole(full, *split, dist.get_rank(layout.group), layout.size).to(param.dtype)
                )
                del full
                continue
            if experts.is_expert(pm.hf[0]):  # stacked [E, ...]: per-expert maps, so a slice of E maps alike
                rows = _local_rows(param)
                part = pm.to_megatron([experts.get(pm.hf[0], rows)])
                _check_shape(pm, (experts.experts(pm.hf[0]), *part.shape[1:]), param)
                if rows is None:
                    fill_param(param, part.to(param.dtype))
                else:
                    param.to_local().copy_(part.to(param.dtype))
                continue
            rows = _local_rows(param) if pm.is_copy else None
            if rows is not None:
                _check_shape(pm, tuple(ckpt.shape(pm.hf[0])), param)
                param.to_local().copy_(ckpt.get_rows(pm.hf[0], *rows).to(param.dtype))
                continue
            full = pm.to_megatron(ckpt.get_many(pm.hf))
            _check_shape(pm, tuple(full.shape), param)
            fill_param(param, full.to(param.dtype))
            del full
        if stage is None:  # a stage reads its own tensors only: the others are the other stages'
            ckpt.check_consumed(ignorable_hf_names(fields))
    return len(maps)
