"""LoRA on megatron-core's linear layers: one adapter pair per Hugging Face projection, the base frozen.

``model.lora.rank`` r > 0 gives each targeted projection W (``model.lora.target_modules``, Hugging
Face names) an update (alpha / r) * B A, A [r, in] and B [out, r], as PEFT does: so our adapters
*are* PEFT's, one to one (``peft_names``), with no fusing. megatron-core fuses q/k/v into
``linear_qkv`` (grouped per query group) and gate/up into ``linear_fc1``; the adapters of a fused
layer sit beside it (``linear_qkv.adapters.q_proj.lora_A``, ...) and their outputs are laid out as
the fused weight's rows are (``LoRA.forward``), so (alpha / r) * B A of each projection is exactly
what merging adds to that projection's rows. A fused adapter with one A shared by q, k and v
would be cheaper but could not hold PEFT's three separate A's.

Tensor parallelism (Megatron-Bridge's rule, so TP 2 computes what TP 1 does):

- column-parallel layers (``linear_qkv``, ``linear_fc1``): A whole on every TP rank, B split like
  the base's rows (each rank its own heads, its own gate / up rows). The input is the base's
  (gathered from the sequence-parallel slices, or copied into the TP region), so A's gradient is
  partial over TP (each rank back-propagates through its own rows of B): it is added over TP with
  the norms' (``tensor_parallel.sum_partial_grads``).
- row-parallel layers (``linear_proj``, ``linear_fc2``): A split like the base's columns, B whole;
  x A^T is summed over TP (reduce-scattered to the sequence-parallel slices under SP, where B's
  gradient is then partial and added over TP).

Initialisation is PEFT's: A ~ U(-1/sqrt(in), 1/sqrt(in)) (kaiming-uniform, a = sqrt(5)) drawn for
the *whole* A from ``train.seed`` and the parameter's whole-model name, then sliced, so it does
not depend on TP or PP (Megatron-Bridge once drew it per shard and grew its std by sqrt(TP));
B = 0, so the model starts as the base, bitwise.

The adapters are added by a forward hook on the base layer, so no base parameter changes its name
(checkpoints, HF import and export, the weight stream keep theirs). ``adapters_off`` runs the
model as its base: the reference policy of the KL penalty costs no second copy.
"""

from __future__ import annotations

import contextlib
import math
import re
import zlib
from collections.abc import Iterable, Iterator

import torch

from backend.megatron_compat import import_megatron_module

#: megatron-core layer (suffix in a decoder layer) -> the HF projections it fuses, in its row order.
FUSED = {
    "self_attention.linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "self_attention.linear_proj": ("o_proj",),
    "mlp.linear_fc1": ("gate_proj", "up_proj"),
    "mlp.linear_fc2": ("down_proj",),
}
#: column-parallel layers (rows split over TP); the others are row-parallel (columns split).
COLUMN = ("self_attention.linear_qkv", "mlp.linear_fc1")
#: HF module of each projection inside ``model.layers.N``.
HF_PARENT = {
    p: ("self_attn" if p in FUSED["self_attention.linear_qkv"] + ("o_proj",) else "mlp")
    for p in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
}
#: Our adapter parameter names: ``decoder.layers.N.<layer>.adapters.<proj>.lora_{A,B}``.
ADAPTER = re.compile(r"(.*)decoder\.layers\.(\d+)\.(.+)\.adapters\.(\w+)\.lora_([AB])")
MARK = ".adapters."


def is_adapter(name: str) -> bool:
    return MARK in name


class Adapter(torch.nn.Module):
    """One projection's pair: ``lora_A`` [r, in] and ``lora_B`` [out, r] (this rank's slices)."""

    def __init__(self, rank: int, in_features: int, out_features: int):
        super().__init__()
        self.lora_A = torch.nn.Parameter(torch.zeros(rank, in_features))
        self.lora_B = torch.nn.Parameter(torch.zeros(out_features, rank))


class LoRA(torch.nn.Module):
    """The adapters of one megatron-core linear layer and how their outputs join the base's."""

    def __init__(
        self, layer: str, shapes: dict, *, rank: int, alpha: float, dropout: float, tp: int, sp: bool, geometry=None
    ):
        super().__init__()
        self.layer, self.column = layer, layer in COLUMN
        self.adapters = torch.nn.ModuleDict({p: Adapter(rank, *shapes[p]) for p in shapes})  # lora_A 0 until set
        self.scaling = alpha / rank
        self.dropout = torch.nn.Dropout(dropout) if dropout else torch.nn.Identity()
        self.tp, self.sp = tp, sp
        self.geometry = geometry  # linear_qkv: (local query groups, heads per group, head dim)
        self.enabled = True
        for adapter in self.adapters.values():
            _mark(adapter, column=self.column, tp=tp, sp=sp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mappings = import_megatron_module("megatron.core.tensor_parallel.mappings") if self.tp > 1 else None
        if self.column and mappings is not None:  # the base layer's own input: all tokens, all features
            x = (
                mappings.gather_from_sequence_parallel_region(x)
                if self.sp
                else mappings.copy_to_tensor_model_parallel_region(x)
            )
        x = self.dropout(x)
        outs = {}
        for name, a in self.adapters.items():
            h = x @ a.lora_A.to(x.dtype).t()
            if not self.column and mappings is not None:  # each rank holds a slice of the features
                h = (
                    mappings.reduce_scatter_to_sequence_parallel_region(h)
                    if self.sp
                    else mappings.reduce_from_tensor_model_parallel_region(h)
                )
            outs[name] = h @ a.lora_B.to(x.dtype).t()
        if len(outs) == 1:
            delta = next(iter(outs.values()))
        elif self.layer == "self_attention.linear_qkv":  # per group: its query heads, its key, its value
            groups, per, head = self.geometry
            lead = outs["q_proj"].shape[:-1]
            delta = torch.cat(
                [
                    outs["q_proj"].reshape(*lead, groups, per * head),
                    outs["k_proj"].reshape(*lead, groups, head),
                    outs["v_proj"].reshape(*lead, groups, head),
                ],
                dim=-1,
            ).reshape(*lead, groups * (per + 2) * head)
        else:  # linear_fc1: [gate; up] (this rank's halves)
            delta = torch.cat([outs["gate_proj"], outs["up_proj"]], dim=-1)
        return delta * self.scaling


def _mark(adapter: Adapter, *, column: bool, tp: int, sp: bool) -> None:
    """megatron-core's split attributes on the split one (``tensor_parallel.record_layout`` reads
    them: checkpoints, exports and the stream see whole tensors), and which gradient is partial."""
    if tp == 1:
        return
    split, whole = (adapter.lora_B, adapter.lora_A) if column else (adapter.lora_A, adapter.lora_B)
    split.tensor_model_parallel = True
    split.partition_dim = 0 if column else 1
    split.partition_stride = 1
    if column or sp:
        whole.partial_over_tp = True


def _hook(module, args, output):
    lora = module.lora
    if not lora.enabled:
        return output
    out, bias = output
    return out + lora(args[0]).to(out.dtype), bias


def attach(model: torch.nn.Module, lora_cfg, *, fields: dict, tp: int = 1, sequence_parallel: bool = False) -> int:
    """Give every targeted layer of ``model`` (a plain GPTModel or one stage) its adapters and
    freeze everything else (a critic's value head stays trainable). Returns the adapter count."""
    targets = set(lora_cfg.target_modules)
    count = 0
    for name, module in list(model.named_modules()):
        layer = next((k for k in FUSED if name.endswith("." + k) and ".layers." in name), None)
        if layer is None:
            continue
        projections = [p for p in FUSED[layer] if p in targets]
        if not projections:
            continue
        out_local, in_local = module.weight.shape
        if layer == "self_attention.linear_qkv":
            n, g, h = fields["num_attention_heads"], fields["num_query_groups"], fields["head_dim"]
            groups = g // tp
            rows = {"q_proj": groups * (n // g) * h, "k_proj": groups * h, "v_proj": groups * h}
            shapes = {p: (in_local, rows[p]) for p in projections}
            geometry = (groups, n // g, h)
        elif layer == "mlp.linear_fc1":
            shapes = {p: (in_local, out_local // 2) for p in projections}
            geometry = None
        else:  # row-parallel: A [r, in / tp], B [out, r]
            shapes = {p: (in_local, out_local) for p in projections}
            geometry = None
        if len(projections) < len(FUSED[layer]) and len(FUSED[layer]) > 1:
            shapes = {p: shapes[p] for p in projections}
        module.lora = LoRA(
            layer,
            shapes,
            rank=lora_cfg.rank,
            alpha=lora_cfg.alpha,
            dropout=lora_cfg.dropout,
            tp=tp,
            sp=sequence_parallel,
            geometry=geometry,
        )
        module.register_forward_hook(_hook)
        count += len(projections)
    return count


def freeze_base(model: torch.nn.Module, *, value_head: bool) -> None:
    """Only adapters (and a critic's new value head) train."""
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name) or (value_head and "output_layer." in name))


def layers(model: torch.nn.Module) -> Iterator[LoRA]:
    for module in model.modules():
        if isinstance(module, LoRA):
            yield module


@contextlib.contextmanager
def adapters_off(model: torch.nn.Module):
    """Run ``model`` as its base (the KL penalty's reference policy); a model without adapters as is."""
    held = list(layers(model))
    for lora in held:
        lora.enabled = False
    try:
        yield model
    finally:
        for lora in held:
            lora.enabled = True


def as_reference(model: torch.nn.Module):
    """``model`` run as the KL penalty's reference: the policy itself with its adapters off when
    the engine made it its own reference (``model.base_is_reference``, LoRA with no
    ``loss.reference_checkpoint``); any other reference model as it is (a reference checkpoint
    of ours with trained adapters keeps them)."""
    return adapters_off(model) if getattr(model, "base_is_reference", False) else contextlib.nullcontext(model)


def has_adapters(model: torch.nn.Module) -> bool:
    return next(layers(model), None) is not None


def seed_for(seed: int, whole_name: str) -> int:
    """A's draw for one parameter: the run's seed and its whole-model name (TP and PP invariant)."""
    return (seed * 1_000_003 + zlib.crc32(whole_name.encode())) % (2**63 - 1)


def whole_init(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The whole tensor an adapter parameter starts from: A ~ PEFT's kaiming-uniform (bound
    1/sqrt(in)), B = 0."""
    if name.endswith("lora_B"):
        return torch.zeros(shape)
    bound = 1.0 / math.sqrt(shape[1])
    g = torch.Generator().manual_seed(seed_for(seed, name))
    return torch.empty(shape).uniform_(-bound, bound, generator=g)


def merged(
    named: Iterable[tuple[str, torch.Tensor]], fields: dict, scaling: float, maps: dict
) -> Iterator[tuple[str, torch.Tensor]]:
    """A (name, full tensor) stream of the whole model with each targeted base weight merged,
    W + (alpha / r) B A, and no adapter entries: what a generator or a merged export loads.
    A layer's adapters follow its weight and bias in the stream (``state_dict`` order), so that
    layer's entries are held until its adapters have passed: one layer's tensors at a time.
    ``maps``: megatron name -> its ``ParamMap`` (whose ``to_megatron`` fuses q/k/v and gate/up)."""
    prefix: str | None = None
    held: list[tuple[str, torch.Tensor]] = []
    parts: dict[str, dict[str, torch.Tensor]] = {}

    def flush():
        out = []
        for name, tensor in held:
            if name == f"{prefix}.weight" and parts and isinstance(tensor, torch.Tensor):
                tensor = _merge(name, tensor, parts, fields, scaling, maps)
            out.append((name, tensor))
        return out

    for name, tensor in named:
        if prefix is not None and name.startswith(prefix + "."):
            m = ADAPTER.fullmatch(name)
            if m:
                parts.setdefault(m.group(4), {})[m.group(5)] = tensor
            else:
                held.append((name, tensor))
            continue
        if prefix is not None:
            yield from flush()
            prefix, held, parts = None, [], {}
        layer = next((k for k in FUSED if name.endswith(f".{k}.weight")), None)
        if layer is not None and ".layers." in name:
            prefix, held = name.removesuffix(".weight"), [(name, tensor)]
        else:
            yield name, tensor
    if prefix is not None:
        yield from flush()


def _merge(name: str, weight: torch.Tensor, parts: dict, fields: dict, scaling: float, maps: dict) -> torch.Tensor:
    projections = FUSED[next(k for k in FUSED if name.endswith(f".{k}.weight"))]
    rows = _projection_rows(projections, fields, weight)
    deltas = []
    for p, r in zip(projections, rows):
        pair = parts.get(p)
        if pair is None:
            deltas.append(torch.zeros(r, weight.shape[1], dtype=torch.float32, device=weight.device))
        else:
            deltas.append(
                scaling * (pair["B"].to(weight.device, torch.float32) @ pair["A"].to(weight.device, torch.float32))
            )
    delta = deltas[0] if len(deltas) == 1 else maps[name].to_megatron(deltas)
    return (weight.to(torch.float32) + delta).to(weight.dtype)


def _projection_rows(projections, fields, weight) -> list[int]:
    if projections == FUSED["self_attention.linear_qkv"]:
        n, g, h = fields["num_attention_heads"], fields["num_query_groups"], fields["head_dim"]
        return [n * h, g * h, g * h]
    if projections == FUSED["mlp.linear_fc1"]:
        return [weight.shape[0] // 2] * 2
    return [weight.shape[0]]


@torch.no_grad()
def init_adapters(model: torch.nn.Module, seed: int, *, stage=None) -> int:
    """Every adapter's starting values on ``model``: ``whole_init`` of each (``fill_adapters``)."""
    return len(fill_adapters(model, lambda name, shape: whole_init(name, shape, seed), stage=stage))


@torch.no_grad()
def fill_adapters(model: torch.nn.Module, whole_of, *, stage=None) -> list[str]:
    """Set every adapter of ``model`` (plain, or FSDP2-sharded with TP slices) from
    ``whole_of(whole-model name, whole shape)``, the whole tensor (the same under any TP or PP),
    cut to this rank's slice and shard. Returns the whole-model names set."""
    from torch.distributed import get_rank

    from .hf.load import fill_param
    from .tensor_parallel import plain_name, slice_of_whole, tp_layout, whole_shape

    layout = tp_layout(model)
    done = []
    for name, param in model.named_parameters():
        local = plain_name(name)
        if not is_adapter(local):
            continue
        whole_name = local if stage is None else stage.source(local)
        whole = whole_of(whole_name, whole_shape(model, local, param.shape))
        split = layout.splits.get(local)
        if split is not None:
            whole = slice_of_whole(whole, *split, get_rank(layout.group), layout.size)
        fill_param(param, whole.to(param.dtype))
        done.append(whole_name)
    return done


def trainable_count(model: torch.nn.Module) -> int:
    """Trained parameters of the whole model (TP slices counted whole; under PP every stage's,
    from the whole model on the meta device)."""
    from .tensor_parallel import plain_name, tp_layout

    whole = getattr(model, "whole_meta", model)
    layout = tp_layout(whole)
    return sum(
        p.numel() * (layout.size if plain_name(n) in layout.splits else 1)
        for n, p in whole.named_parameters()
        if p.requires_grad
    )


def describe(lora_cfg, trainable: int, total: int) -> str:
    """The start-up summary's LoRA line: what trains, and AdamW's state for it (two FP32 moments
    a trained parameter) against full fine-tuning's."""
    mb = 8 / 2**20
    return (
        f"rank {lora_cfg.rank}, alpha {lora_cfg.alpha:g} on {', '.join(lora_cfg.target_modules)}: "
        f"{trainable:,} trained parameters ({100 * trainable / max(total, 1):.2f}% of {total:,}), the base frozen; "
        f"optimizer state {trainable * mb:,.1f} MiB over the world (full fine-tuning: {total * mb:,.1f} MiB)"
    )


def merge_stream(model: torch.nn.Module, named: Iterable[tuple[str, torch.Tensor]], fields: dict):
    """``named`` (the whole model's (name, full tensor) stream) with ``model``'s adapters merged
    into their base weights (``merged``); as it is for a model without adapters."""
    held = next(layers(getattr(model, "whole_meta", model)), None)
    if held is None:
        return named
    from .hf.mapping import hf_to_megatron_names

    maps = {pm.megatron: pm for pm in hf_to_megatron_names(fields)}
    return merged(named, fields, held.scaling, maps)
