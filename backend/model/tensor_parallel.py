"""Tensor parallelism's bookkeeping around megatron-core's layers: which parameters are split,
how a whole tensor maps to a rank's slice and back, and which gradients TP must add up.

Layers (``build_gpt`` with ``tp`` > 1): megatron-core's column-parallel ``linear_qkv`` /
``linear_fc1`` / output layer (split on dim 0), row-parallel ``linear_proj`` / ``linear_fc2`` (dim
1) and the vocabulary-parallel embedding (dim 0). Chosen over DTensor plans because the model *is*
megatron-core's GPTModel (its layers take the TP group and compute what its attention and MLP
expect, where torch's ``ColwiseParallel`` plans want ``nn.Linear`` modules), because their
communication runs over gloo on CPU (``tp_compat``), and because FSDP2 composes with them
unchanged: it shards each rank's slice, a plain tensor, over the ranks holding the same slice.
Checkpoints, exports and the weight stream see whole tensors (``gather_slices``) and HF import
cuts them (``slice_of_whole``), so nothing outside the model knows the TP size.

A split parameter's slice follows megatron-core's ``partition_dim`` / ``partition_stride``: the
whole tensor cut into tp x stride blocks along the dim, rank r keeping blocks r, r + tp, ... The
SwiGLU ``linear_fc1`` has stride 2: rank r keeps [gate_r; up_r], not one contiguous block.

Gradients TP must add (``sum_partial_grads``, after the backward, before the norm and update): a
norm's weight under sequence parallelism (each rank normalised a 1/tp slice of the tokens) and
the QK-norm weights always (each rank normalised its own heads): megatron-core's
``finalize_model_grads`` adds the same ones over the TP group. MoE layers under TP (sequence
parallelism required): the router and the experts are whole on every TP rank (expert tensor
parallelism 1), and each rank routes only its sequence-parallel slice of the tokens through them,
so their gradients are partial over TP too, and the router statistics sum over TP as over CP
(``moe_stats``): the MoE layer is token-parallel over TP, with no gather of the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from backend.distributed.collectives import all_gather_tensors, dist_sum


@dataclass
class TPLayout:
    """What TP split in a model: name -> (dim, stride) of each split parameter, the names whose
    gradients are partial over TP, and the group (None: not split)."""

    splits: dict[str, tuple[int, int]] = field(default_factory=dict)
    partial_grads: tuple[str, ...] = ()
    group: object = None
    # Parameters held once over the whole world although not split over TP: the experts under
    # expert parallelism (their (expert_dp, ep) mesh covers every rank once, TP ranks included),
    # so a gradient norm counts them once, not once a TP rank.
    held_once: tuple[str, ...] = ()

    @property
    def size(self) -> int:
        return 1 if self.group is None else self.group.size()


def plain_name(name: str) -> str:
    """A parameter's name without wrapper prefixes (activation checkpointing's, DDP's, compile's):
    the name the layout, the HF mapping and ``state_dict`` share."""
    for prefix in ("module.", "_orig_mod.", "_checkpoint_wrapped_module."):
        name = name.replace(prefix, "")
    return name


def torch_norm_class():
    """megatron-core's torch RMSNorm builder without its refusal of sequence parallelism (it
    refuses because nothing there marks the weight; we mark it, and add its gradient over TP)."""

    class TorchNorm:
        def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_):
            norm = torch.nn.RMSNorm(hidden_size, eps=eps)
            norm.weight.sequence_parallel = bool(config.sequence_parallel)
            return norm

    return TorchNorm


def record_layout(model: torch.nn.Module, group, *, ep_size: int = 1) -> TPLayout:
    """Read the split of every parameter from megatron-core's attributes (before FSDP2 replaces the
    parameters) and keep it on the model as ``model.tp_layout``. ``ep_size`` > 1: the experts'
    gradients are whole already (every token routed to an expert reaches its rank through the
    all-to-all, and FSDP2 sums its copies over ``expert_dp``, which spans the TP ranks)."""
    layout = TPLayout(group=group)
    if group is not None and group.size() > 1:
        for name, p in model.named_parameters():
            name = plain_name(name)
            if getattr(p, "tensor_model_parallel", False):
                layout.splits[name] = (int(p.partition_dim), int(getattr(p, "partition_stride", 1)))
            elif (
                getattr(p, "sequence_parallel", False)
                or getattr(p, "partial_over_tp", False)  # LoRA: A of a column-parallel layer (lora.py)
                or "q_layernorm" in name
                or "k_layernorm" in name
                or ".mlp.router." in name  # MoE under TP: each rank routes its own slice of the tokens
                or (".mlp.experts." in name and ep_size == 1)  # through whole experts (moe_compat)
            ):
                layout.partial_grads += (name,)
            if ".mlp.experts." in name and ep_size > 1:
                layout.held_once += (name,)
    model.tp_layout = layout
    return layout


def whole_numel(layout: TPLayout, model) -> int:
    """The model's parameter count with every TP slice counted whole (what the model has)."""
    return sum(p.numel() * (layout.size if plain_name(n) in layout.splits else 1) for n, p in model.named_parameters())


def tp_layout(model) -> TPLayout:
    return getattr(model, "tp_layout", None) or TPLayout()


def _blocks(t: torch.Tensor, dim: int, stride: int, parts: int) -> tuple[torch.Tensor, ...]:
    size = t.shape[dim]
    if size % (parts * stride):
        raise ValueError(f"dimension {dim} of size {size} does not split into {parts} x {stride} blocks")
    return torch.split(t, size // (parts * stride), dim=dim)


def slice_of_whole(whole: torch.Tensor, dim: int, stride: int, rank: int, tp: int) -> torch.Tensor:
    """Rank ``rank``'s slice of a whole tensor (megatron-core's CPU initialisation's own cut)."""
    blocks = _blocks(whole, dim, stride, tp)
    return torch.cat(blocks[rank::tp], dim=dim)


def whole_of_slices(slices: list[torch.Tensor], dim: int, stride: int) -> torch.Tensor:
    """The whole tensor from every rank's slice, in rank order (``slice_of_whole`` undone)."""
    tp = len(slices)
    per_rank = [_blocks(s, dim, stride, 1) for s in slices]
    return torch.cat([per_rank[r][k] for k in range(stride) for r in range(tp)], dim=dim)


def gather_slices(local: torch.Tensor, dim: int, stride: int, group) -> torch.Tensor:
    """The whole tensor of a split parameter on every TP rank (one all-gather of the slices)."""
    return whole_of_slices(all_gather_tensors(local, group), dim, stride)


def full_param(model, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (this rank's whole slice of parameter ``name``, or its gradient) as the whole
    tensor: gathered over TP when the parameter is split; as it is otherwise."""
    layout = tp_layout(model)
    split = layout.splits.get(plain_name(name))
    if split is None:
        return tensor
    return gather_slices(tensor, *split, layout.group)


def whole_shape(model, name: str, shape) -> tuple[int, ...]:
    """The whole tensor's shape from a slice's shape (FSDP2's global shape is the slice's)."""
    layout = tp_layout(model)
    split = layout.splits.get(plain_name(name))
    shape = tuple(shape)
    if split is None:
        return shape
    dim = split[0]
    return (*shape[:dim], shape[dim] * layout.size, *shape[dim + 1 :])


def sum_partial_grads(model) -> None:
    """Add over TP the gradients each TP rank holds only a part of (see the module docstring).
    Under FSDP2 each is the rank's shard: the TP ranks of one FSDP2 coordinate hold the same rows."""
    layout = tp_layout(model)
    if not layout.partial_grads:
        return
    params = {plain_name(n): p for n, p in model.named_parameters()}
    for name in layout.partial_grads:
        grad = params[name].grad
        if grad is None:
            continue
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        dist_sum(local, layout.group)
