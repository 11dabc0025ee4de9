"""A critic's value head under tensor parallelism: whole on every TP rank.

The head maps a hidden state to one value (hidden -> 1, with a bias), so there is nothing to split
over TP: each TP rank holds the whole [1, hidden] weight, initialised from the same draws as the
column-parallel head at TP 1 (megatron-core's CPU initialisation draws the whole weight too), so
TP 2 starts from TP 1's numbers. With sequence parallelism the final norm's output is split over
the TP ranks by sequence; the head all-gathers it first, and its backward hands each rank only
its own slice of the gradient (``tensor_parallel_output_grad=False``): every TP rank computes the
same values and the same loss, so summing their gradients (a reduce-scatter, what the vocabulary
head's backward does) would count them tp times. The weight's gradient is likewise the same on
every TP rank: the gradient norm counts it once (``apply_update``'s copies for unsplit
parameters) and nothing adds it over TP.
"""

from __future__ import annotations

import torch

from backend.megatron_compat import import_megatron_module


class ReplicatedValueHead(torch.nn.Module):
    """megatron-core's output-layer call (``layer(hidden, weight=None, runtime_gather_output=None)
    -> (values, None)``) over a whole head; parameter names ``weight`` / ``bias`` as the TP 1 head's,
    so checkpoints, Hugging Face import and export see the same tensors."""

    def __init__(self, config):
        super().__init__()
        self.sequence_parallel = bool(config.sequence_parallel)
        self.weight = torch.nn.Parameter(torch.empty(1, config.hidden_size, dtype=torch.float32))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=torch.float32))
        with torch.no_grad():
            config.init_method(self.weight)

    def forward(self, hidden: torch.Tensor, weight=None, runtime_gather_output=None, **_):
        if self.sequence_parallel:
            mappings = import_megatron_module("megatron.core.tensor_parallel.mappings")
            hidden = mappings.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden, self.weight.to(hidden.dtype), self.bias.to(hidden.dtype)), None
