"""Data parallelism with torch FSDP2 (``fully_shard``) over the data x context parallel group.

Why FSDP2 rather than megatron-core DDP: it keeps FP32 master weights sharded while computing in
BF16 (MixedPrecisionPolicy) with a plain torch AdamW, where megatron-core's mixed-precision and
distributed optimizers are CUDA-only; it checkpoints through torch.distributed.checkpoint; and
its per-microbatch all-gather / reduce-scatter is exactly the overhead dynamic batching removes,
as in the reference measurement (FSDP on two GPUs). It trains megatron-core's GPTModel on CPU
over gloo unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from .collectives import dist_sum


def uses_fsdp(env, *, bf16: bool) -> bool:
    """Whether ``wrap_fsdp`` shards: over more than one rank (``ParallelDims.fsdp_enabled``), or
    at one rank in BF16, whose FP32 master weights and BF16 compute are FSDP2's
    ``MixedPrecisionPolicy``. An FP32 run on one rank trains the plain module (no gather, no
    reduce-scatter, no hook): its parameters are plain tensors, not DTensors."""
    return env.dims.fsdp_enabled or bf16


def wrap_fsdp(model: torch.nn.Module, env, *, bf16: bool, expert_modules=()) -> torch.nn.Module:
    """Shard every decoder layer and the whole model over the world. A model on the meta device
    stays there (its shards get storage with ``to_empty`` afterwards); any other is moved first.
    Where FSDP2 has nothing to do (``uses_fsdp``) the model is returned as it is, placed.

    ``expert_modules`` (expert parallelism: their parameters already DTensors over the EP mesh
    dimension) are sharded first, over ``env.dims.mesh("expert_dp")``: the ranks that hold the
    same experts; the layer around them then leaves their parameters alone."""
    if not any(p.is_meta for p in model.parameters()):
        model.to(env.device)
    if not uses_fsdp(env, bf16=bf16):
        return model
    mesh = env.dims.mesh("fsdp")  # dp x cp: the ranks holding distinct tokens
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    )
    # The experts' inputs are the layer's own tensors (tokens, routing probabilities, counts): cast
    # nothing, so their dtypes are what they are at EP 1 (a router in FP32 keeps FP32 probabilities).
    expert_mp = dataclasses.replace(mp, cast_forward_inputs=False)
    # Pipeline parallelism: a stage's microbatches interleave forwards and backwards (1F1B), so
    # resharding after each forward would gather every layer twice a microbatch; its parameters
    # stay gathered through the step instead (``set_grad_sync``'s ``pipelined``: resharded after
    # the last microbatch's backward), as torchtitan does under PP. Costs the stage's unsharded
    # parameters for the step (its layers only: 1/PP of the model).
    keep = {"reshard_after_forward": False} if env.pp_size > 1 else {}
    for module in expert_modules:
        fully_shard(module, mesh=env.dims.mesh("expert_dp"), mp_policy=expert_mp, **keep)
    for layer in model.decoder.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, **keep)
    # Registered before fully_shard, so it runs before FSDP2's post-forward hook (hooks run in
    # registration order) and FSDP never sees a view (see _own_output).
    model.register_forward_hook(_own_output)
    fully_shard(model, mesh=mesh, mp_policy=mp, **keep)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # The loss is already normalised by the window's global token count: sum, don't average.
            module.set_gradient_divide_factor(1.0)
            # Plain SUM collectives: gloo has no PREMUL_SUM, and with a factor of 1 none is needed.
            module.set_force_sum_reduction_for_comms(True)
    return model


def _own_output(_module, _args, output):
    """Give the model's output its own storage when it is a view.

    megatron-core returns the per-token loss as ``loss.transpose(0, 1).contiguous()``; for a
    one-row microbatch ([s, 1] -> [1, s]) the transpose is already contiguous, so ``contiguous()``
    returns the view itself and FSDP2 warns on every such microbatch that an in-place op on it
    could skip its pre-backward hook. Copying a [1, s] loss costs s floats (16 KiB at s = 4096).
    """
    if isinstance(output, torch.Tensor) and output._base is not None:
        return output.clone()
    return output


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float, *, group, copies=None) -> float:
    """The global L2 norm of the gradients, scaling them to ``max_norm`` when above it.

    One mesh (every parameter sharded over the world): torch's ``clip_grad_norm_``, as always.
    Under expert parallelism the expert gradients live on the (expert_dp, ep) mesh and the rest on
    the world's, and DTensor refuses to stack norms across meshes. Every FSDP2 shard is disjoint
    (``Shard`` placements only), so the squared norm is the sum over the world of each rank's local
    squares: one all-reduce of one number, then every gradient clipped by that total (torchtitan
    completes each mesh's norm on its own; one sum over the world is the same number in one call).
    ``group``: the ranks whose shards make up every parameter (the world).

    Under tensor parallelism the FSDP2 mesh leaves TP out: ``copies[i]`` says on how many TP ranks
    parameter i's shard lives as an identical copy (1 for a split parameter, whose TP slices are
    disjoint; tp for a replicated one), and its square counts once: divided by its copies before
    the one sum over the world."""
    grads = [p.grad for p in params if p.grad is not None]
    if copies is None and len({getattr(g, "device_mesh", None) for g in grads}) <= 1:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    local = []
    for g in grads:
        if not hasattr(g, "placements"):
            raise RuntimeError("a plain-tensor gradient beside sharded ones: its square would be counted once per rank")
        if any(p.is_replicate() or p.is_partial() for p in g.placements):
            raise RuntimeError(f"gradient with placements {g.placements}: only sharded (FSDP2) gradients are expected")
        local.append(g.to_local() if hasattr(g, "to_local") else g)
    squares = [torch.linalg.vector_norm(t, dtype=torch.float64) ** 2 for t in local]
    if copies is not None:
        squares = [sq / c for sq, c in zip(squares, [c for p, c in zip(params, copies) if p.grad is not None])]
    square = torch.stack(squares).sum()
    total = float(dist_sum(square.reshape(1), group=group).sqrt())
    coef = min(1.0, max_norm / (total + 1e-6))
    if coef < 1.0:
        torch._foreach_mul_(local, coef)
    return total


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly sharded) parameter, on every rank (a collective for a DTensor).

    A 2-D placement (an expert-parallel stack: FSDP2's shard over expert_dp inside the EP shard) is
    gathered one mesh dimension at a time: ``DTensor.full_tensor`` does the same two all-gathers
    but warns on every call that it could not merge them (once per expert tensor of an export)."""
    if not hasattr(t, "placements"):
        return t
    from torch.distributed.tensor import Replicate

    for i, placement in enumerate(t.placements):
        if not placement.is_replicate():
            t = t.redistribute(placements=[*t.placements[:i], Replicate(), *t.placements[i + 1 :]])
    return t.to_local()


def set_grad_sync(model: torch.nn.Module, enabled: bool, *, pipelined: bool = False) -> None:
    """Reduce gradients only on a step's last microbatch; earlier ones accumulate locally.
    ``pipelined``: reshard the parameters only then too (gathered once a step, see ``wrap_fsdp``)."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
        if pipelined:
            model.set_reshard_after_backward(enabled)


@contextlib.contextmanager
def forward_only(model: torch.nn.Module) -> Iterator[None]:
    """Forward passes with no backward (validation, recomputed or reference log-probabilities):
    eval mode and no autograd inside; on exit every FSDP2 module is resharded and the mode restored.

    Why the reshard: FSDP2 keeps the root module's parameters unsharded after its forward (the
    backward would need them at once). With no backward to follow, they stayed unsharded, and the
    next training step's gradients of the root-owned parameters (embedding, final norm) came out
    exactly doubled (measured on CPU with torch 2.13: embedding gradient norm 0.337 -> 0.674, so a
    validation pass silently skewed the step after it). ``FSDPModule.reshard`` puts them back.
    """
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        model.train(was_training)
