"""GPT-OSS experts as stacked weights run by one grouped GEMM per projection (``torch._grouped_mm``).

megatron-core 0.16.1 offers three expert modules: ``SequentialMLP`` (one ``MLP`` per expert, run
one after another: 2 GEMMs, a GLU and a bias add per expert, so 32 experts x 24 layers of
GPT-OSS-20B are 768 small launches per forward), ``GroupedMLP`` (needs the CUDA-only
``grouped_gemm`` package) and ``TEGroupedMLP`` (needs Transformer Engine). This module is a drop-in
for the ``experts`` slot of megatron-core's ``MoELayer`` (same constructor and forward contract:
tokens arrive permuted, grouped by expert, with ``tokens_per_expert`` and their routing
probabilities) that runs on any device with torch alone: each projection is one
``torch._grouped_mm`` over all experts (CPU and CUDA; on CUDA it is the grouped kernel for BF16 on
compute capability 9.x, i.e. H100/H200), with a per-expert loop where the kernel does not
apply (other GPUs, FP32 on CUDA, dimensions not multiples of 8 in 16-bit dtypes). On CUDA each
expert's token group is padded with zero-probability rows to a multiple of 8 (the kernel's
alignment). ``tools/bench/bench_moe_experts.py`` times the grouped and the per-expert path side by side
(CPU, FP32, GPT-OSS-20B's layer at a quarter of its width, 32 experts top 4: 2.45x).

Parameters are stacked per expert, in the layout the GEMM wants (in-major, ``x @ W``), which is
Hugging Face GPT-OSS's own layout up to the gate/up interleave:

- ``fc1_weight`` [E, hidden, 2I]: columns 0..I-1 the gate units, I..2I-1 the up units
  (megatron-core's GLU order; HF interleaves them: ``hf.gpt_oss.deinterleave_gate_up``);
- ``fc1_bias`` [E, 2I], same order; ``fc2_weight`` [E, I, hidden]; ``fc2_bias`` [E, hidden].

The math is megatron-core ``MLP.forward`` for an expert with biases, unfused: ``h = x W1 + b1``;
``g, u = chunk(h)``; clamp ``g <= L`` and ``-L <= u <= L``; ``a = act(g) * (u + offset)``;
``a *= p`` (the token's routing probability); ``y = a W2 + b2 * p``. FSDP2 shards the stacks along
the expert dimension; under expert parallelism (``expert_parallel``) a rank holds E / EP of them
and ``exchange`` sends it the tokens of the whole EP group that its experts serve.
"""

from __future__ import annotations

import functools

import torch

from backend.megatron_compat import import_megatron_module


def grouped_mm_applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs this [T, K] x [E, K, N] product (else: a per-expert loop).

    The kernel arrived for CUDA in torch 2.8 and for CPU in 2.9; both operands must share a dtype.
    CUDA: BF16 on compute capability 9.x (Hopper, the kernel's tested target; other GPUs take the
    loop) with strides 16-byte multiples (dims % 8 in 16-bit dtypes). CPU: FP32 or BF16, the
    same alignment rule for BF16."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != w.dtype:
        return False
    k, n = w.shape[1], w.shape[2]
    if x.dtype in (torch.bfloat16, torch.float16) and (k % 8 or n % 8):
        return False
    if x.device.type == "cuda":
        return (
            _torch_release() >= (2, 8)
            and x.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device)[0] == 9
        )
    return x.device.type == "cpu" and _torch_release() >= (2, 9) and x.dtype in (torch.float32, torch.bfloat16)


@functools.cache
def _torch_release() -> tuple[int, ...]:
    """torch's release numbers: a container's "2.8.0a0+...nv25.06" is (2, 8, 0) (as a string it
    compares below "2.8")."""
    from packaging.version import Version

    return Version(torch.__version__).release


def group_alignment(x: torch.Tensor, w: torch.Tensor) -> int:
    """Rows each expert's group is padded to a multiple of. CUDA's grouped kernel needs every group
    boundary 16-byte aligned along the token dimension (the weight-gradient GEMM contracts over
    it), i.e. 8 rows in BF16, as torchtitan pads its token groups; 1 (no padding) elsewhere."""
    return 8 if x.device.type == "cuda" and grouped_mm_applies(x, w) else 1


def grouped_linear(x: torch.Tensor, w: torch.Tensor, counts: list[int], offsets: torch.Tensor) -> torch.Tensor:
    """[T, K] rows grouped by expert (``counts[e]`` rows for expert e, in order) times ``w[e]`` [K, N]."""
    if grouped_mm_applies(x, w):
        return torch._grouped_mm(x, w, offs=offsets)
    pieces = [part @ w[e] for e, part in enumerate(torch.split(x, counts))]
    return torch.cat(pieces) if pieces else x.new_zeros(0, w.shape[2])


def padded_groups(counts: list[int], align: int) -> tuple[list[int], list[int]]:
    """(padded counts, destination row of every real token) when each group is rounded up to a
    multiple of ``align`` rows (at least ``align``: the kernels are never given an empty group)."""
    padded = [max(align, -(-c // align) * align) for c in counts]
    dest, start = [], 0
    for c, p in zip(counts, padded):
        dest.extend(range(start, start + c))
        start += p
    return padded, dest


def _local(param: torch.Tensor) -> torch.Tensor:
    """This rank's experts: under expert parallelism FSDP2's unsharded parameter is a DTensor over
    the EP mesh dimension (its local part is E / EP experts, differentiably)."""
    return param.to_local() if hasattr(param, "to_local") else param


@functools.cache
def grouped_experts_class() -> type:
    """The experts module (a ``MegatronModule``, built once per process)."""
    megatron_module = import_megatron_module("megatron.core.transformer.module").MegatronModule

    class GroupedExperts(megatron_module):
        def __init__(self, num_local_experts: int, config, submodules=None, pg_collection=None):
            super().__init__(config=config)
            e, h, i = num_local_experts, config.hidden_size, config.moe_ffn_hidden_size
            dtype = config.params_dtype
            self.num_local_experts = e  # megatron-core's dispatcher sees all E (its EP size is 1)
            self.experts_per_rank = e  # E / EP once ``expert_parallel.place_experts`` ran
            self.exchange = None  # expert parallelism: tokens to their experts' ranks and back
            self.fc1_weight = torch.nn.Parameter(torch.empty(e, h, 2 * i, dtype=dtype))
            self.fc1_bias = torch.nn.Parameter(torch.zeros(e, 2 * i, dtype=dtype))
            self.fc2_weight = torch.nn.Parameter(torch.empty(e, i, h, dtype=dtype))
            self.fc2_bias = torch.nn.Parameter(torch.zeros(e, h, dtype=dtype))
            if config.perform_initialization:  # megatron-core's initialisers (normal std, scaled output)
                with torch.no_grad():
                    for k in range(e):
                        config.init_method(self.fc1_weight[k])
                        config.output_layer_init_method(self.fc2_weight[k])

        def forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor):
            if self.exchange is not None:
                return self.exchange(tokens, tokens_per_expert, probs, self._local_forward), None
            return self._local_forward(tokens, tokens_per_expert, probs), None

        def _local_forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor):
            """This rank's experts on rows sorted by expert (``tokens_per_expert[e]`` for its e-th)."""
            counts = [int(c) for c in tokens_per_expert.tolist()]
            align = group_alignment(tokens, _local(self.fc1_weight))
            dest = None
            if align > 1:  # pad every group with zero rows (probability 0: they add nothing)
                counts, rows = padded_groups(counts, align)
                dest = torch.tensor(rows, dtype=torch.long, device=tokens.device)
                tokens = tokens.new_zeros(sum(counts), tokens.shape[1]).index_copy(0, dest, tokens)
                probs = probs.new_zeros(sum(counts)).index_copy(0, dest, probs)
            out = self._experts(tokens, counts, probs)
            return out if dest is None else out.index_select(0, dest)

        def _experts(self, tokens: torch.Tensor, counts: list[int], probs: torch.Tensor) -> torch.Tensor:
            offsets = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(tokens.device)
            expert_of = torch.repeat_interleave(  # output_size given: the length is not read back
                torch.arange(len(counts), device=tokens.device),
                torch.tensor(counts, device=tokens.device),
                output_size=sum(counts),
            )
            dtype = tokens.dtype
            w1, b1, w2, b2 = (_local(p) for p in (self.fc1_weight, self.fc1_bias, self.fc2_weight, self.fc2_bias))
            h = grouped_linear(tokens, w1, counts, offsets) + b1[expert_of]
            gate, up = torch.chunk(h, 2, dim=-1)
            limit = self.config.activation_func_clamp_value
            if limit is not None:
                gate = gate.clamp(min=None, max=limit)
                up = up.clamp(min=-limit, max=limit)
            act = self.config.activation_func(gate) * (up + self.config.glu_linear_offset)
            scale = probs.unsqueeze(-1)
            act = (act * scale).to(dtype)
            out = grouped_linear(act, w2, counts, offsets)
            return out + (b2[expert_of] * scale).to(dtype)

        def backward_dw(self):  # megatron-core's delayed weight-gradient hook: nothing is delayed here
            return None

    return GroupedExperts


def experts_spec():
    """The layer-spec entry placing ``GroupedExperts`` in megatron-core's MoE experts slot."""
    spec_cls = import_megatron_module("megatron.core.transformer.spec_utils").ModuleSpec
    return spec_cls(module=grouped_experts_class())
