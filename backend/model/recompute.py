"""Activation recomputation: keep less of the forward pass, recompute it in backward.

``model.recompute_granularity`` (megatron-core's names):

- ``selective``: each layer's core attention keeps only q, k, v and recomputes the attention in
  backward. What it saves is the score / probability matrix of a kernel that materialises it
  (SDPA's math path on CPU keeps s^2 x heads floats per sequence: 4 heads x 256^2 x 4 B = 1 MiB
  per 256-token row of the tiny model); flash-style kernels (flex, TE, SDPA's fused paths) keep
  O(s) and gain little.
- ``full``: each decoder layer keeps only its input hidden state and recomputes the whole layer
  in backward, about one more forward per step (~1.33x the step's FLOPs), for the largest cut in
  bytes per token (the probe's ``b``).

How: torch's composable ``checkpoint`` (non-reentrant, hooks only), applied before FSDP2 shards
the layers, as torchtitan orders them. It keeps every parameter's name (state dicts, checkpoints
and the HF maps are unchanged) and, unlike megatron-core's own ``CheckpointFunction``, needs no
CUDA RNG tracker, so the same path runs on CPU. The recomputed forward sees the same inputs and
RNG state, so activations and gradients are the same values (bitwise on CPU, tested; on 2 ranks
with CP 2, packed, in tests/distributed/test_context_parallel.py). One caveat kept in view:
megatron-core calls a layer with keyword arguments only, and checkpoint looks for CUDA tensors among
the positional ones, so it would not restore the CUDA RNG state for a recomputed dropout; the
builder sets every dropout to 0 (``builder.py``), so no recomputed op draws random numbers.
"""

from __future__ import annotations

import torch


def apply_recompute(model: torch.nn.Module, granularity: str) -> list[torch.nn.Module]:
    """Mark the modules ``granularity`` names for recomputation; returns them (none: [])."""
    if granularity == "none":
        return []
    from torch.distributed._composable import checkpoint

    layers = list(model.decoder.layers)
    if granularity == "full":
        targets = layers
    elif granularity == "selective":
        targets = [layer.self_attention.core_attention for layer in layers]
    else:
        raise ValueError(f"model.recompute_granularity={granularity!r}: allowed values are none, selective, full")
    for module in targets:
        checkpoint(module)
    return targets
