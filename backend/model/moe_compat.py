"""megatron-core 0.16.1's mixture-of-experts layer on CPU (and without Transformer Engine): three narrow fixes.

The MoE path we use is the one that runs without CUDA-only kernels: ``TopKRouter`` (softmax score
function) and the ``allgather`` token dispatcher (expert parallel size 1), with our stacked
``grouped_experts`` in the experts slot (megatron-core's ``GroupedMLP`` needs the CUDA
``grouped_gemm`` package, ``TEGroupedMLP`` Transformer Engine, and ``SequentialMLP`` runs the
experts one by one). Reading 0.16.1's ``transformer/moe`` sources, that path constructs on CPU but
fails at its first forward, for two reasons (plus one cost); ``apply_moe_compat()`` patches
exactly these, once per process (idempotent), and each patch is a no-op where the original
already works:

1. ``Router.gating`` (router.py) moves the router weight and bias to
   ``torch.cuda.current_device()`` whenever they are on the CPU, unconditionally: on a CPU-only
   torch that raises "Torch not compiled with CUDA enabled". Patched: when the *input* is on the
   CPU the move is skipped and the rest of ``gating`` runs unchanged (router dtype, then
   ``router_gating_linear``); on any other device the original method runs.
2. ``RouterGatingLinearFunction`` (moe_utils.py) tests ``te_general_gemm is not None``, but that
   name is only bound inside moe_utils' ``try: import transformer_engine`` block: without TE
   every router forward raises ``NameError`` (on CPU and on CUDA without TE). Patched: the module
   global is set to None when missing, which selects megatron-core's own ``torch.mm`` / ``addmm``
   fallback (and its matching backward).
3. ``TopKRouter._apply_expert_bias`` is wrapped in ``torch.compile`` (megatron-core's ``jit_fuser``)
   and called at every training-mode routing, even when expert-bias balancing is off and it does
   nothing: on CPU that compiles an Inductor C++ kernel once per process (about 10 s here, and a
   C++ toolchain is required). Patched: CPU routing maps call the uncompiled original
   (``_torchdynamo_orig_callable``); other devices keep the compiled one.

Not patched, because the path above does not reach them: ``TopKRouter.__init__`` allocates on
CUDA only with ``moe_router_enable_expert_bias`` or a ``global_aux_loss`` (leave both off on
CPU); ``MoEAlltoAllTokenDispatcher`` makes a CUDA stream in its constructor (use ``allgather``);
``GroupedMLP`` allocates on ``torch.cuda.current_device()``; ``SequentialMLP`` with expert biases
adds the fc2 bias in place to a view autograd protects; ``track_moe_metrics(force_initialize
=True)`` (a logging helper we do not call) allocates on "cuda". The aux-loss and z-loss trackers
(``save_to_aux_losses_tracker``) allocate on the loss's device and work on CPU (tested with
``aux_loss`` + z-loss).

Padding: megatron-core's ``padding_mask`` (``GPTModel.forward(..., padding_mask=...)``, [b, s]) is
True at *padding* tokens (its docstrings say the opposite; the code inverts it). It only keeps
them out of the aux / z losses and the expert-bias counts: megatron-core still routes padding to
experts, so ``moe_stats`` removes it from the routing map.
"""

from __future__ import annotations

import logging

import torch

from backend.megatron_compat import import_megatron_module

log = logging.getLogger(__name__)

_APPLIED: list[str] = []


def _patch_router_gating(router_cls) -> None:
    original = router_cls.gating
    moe_utils = import_megatron_module("megatron.core.transformer.moe.moe_utils")

    def gating(self, input: torch.Tensor):
        if input.device.type != "cpu":
            return original(self, input)
        router_dtype = input.dtype
        if self.config.moe_router_dtype == "fp32":
            router_dtype = torch.float32
        elif self.config.moe_router_dtype == "fp64":
            router_dtype = torch.float64
        return moe_utils.router_gating_linear(input, self.weight, self.bias, router_dtype)

    gating.__doc__ = original.__doc__
    gating._moe_compat_original = original
    router_cls.gating = gating


def _patch_expert_bias_update(topk_router_cls) -> bool:
    compiled = topk_router_cls.__dict__["_apply_expert_bias"]
    eager = getattr(compiled, "_torchdynamo_orig_callable", None)
    if eager is None:  # jit_fuser was not torch.compile: nothing to avoid
        return False

    def _apply_expert_bias(self, routing_map, padding_mask=None):
        fn = eager if routing_map.device.type == "cpu" else compiled
        return fn(self, routing_map, padding_mask=padding_mask)

    _apply_expert_bias._moe_compat_original = compiled
    topk_router_cls._apply_expert_bias = _apply_expert_bias
    return True


def apply_moe_compat() -> list[str]:
    """Apply the fixes above (once per process) and return their names. Call before a model with
    MoE layers runs."""
    if _APPLIED:
        return list(_APPLIED)
    router = import_megatron_module("megatron.core.transformer.moe.router")
    moe_utils = import_megatron_module("megatron.core.transformer.moe.moe_utils")
    _patch_router_gating(router.Router)
    _APPLIED.append("Router.gating: no move to CUDA for CPU inputs")
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
        _APPLIED.append("moe_utils.te_general_gemm = None (Transformer Engine absent)")
    if _patch_expert_bias_update(router.TopKRouter):
        _APPLIED.append("TopKRouter._apply_expert_bias: eager on CPU (no Inductor compile)")
    log.info("megatron-core MoE compatibility: %s", "; ".join(_APPLIED))
    return list(_APPLIED)


def gpt_oss_activation(alpha: float = 1.702):
    """GPT-OSS's gate activation ``x * sigmoid(alpha * x)``: megatron-core's ``quick_gelu`` at the
    released alpha 1.702 (so its fused kernels stay eligible), otherwise a plain function."""
    if alpha == 1.702:
        return import_megatron_module("megatron.core.activations").quick_gelu

    def alpha_sigmoid_gate(x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(alpha * x)

    return alpha_sigmoid_gate


def moe_config_kwargs(
    *,
    num_experts: int,
    topk: int,
    moe_ffn_hidden_size: int,
    swiglu_limit: float | None = 7.0,
    swiglu_alpha: float = 1.702,
    aux_loss_coeff: float = 0.0,
) -> dict:
    """``TransformerConfig`` keyword arguments for GPT-OSS-style MoE layers on the CPU-safe path.

    GPT-OSS routing is top-k over the router logits (with bias), then a softmax over the k chosen
    (``moe_router_pre_softmax=False``, ``score_function="softmax"``), no expert-bias balancing. Its
    experts are a clamped SwiGLU with a +1 on the linear half:
    ``(clamp(up, -L, L) + 1) * g * sigmoid(alpha * g)`` with ``g = clamp(gate, max=L)``, i.e.
    megatron-core's unfused GLU with ``glu_linear_offset=1`` and ``activation_func_clamp_value=L``.
    ``add_bias_linear=True`` also puts biases on the attention projections (GPT-OSS has them).
    """
    return dict(
        num_moe_experts=num_experts,
        moe_router_topk=topk,
        moe_ffn_hidden_size=moe_ffn_hidden_size,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=False,
        moe_router_load_balancing_type="aux_loss" if aux_loss_coeff else "none",
        moe_aux_loss_coeff=aux_loss_coeff,
        moe_token_dispatcher_type="allgather",
        # Experts whole on every rank (never split over TP): under TP each rank routes its own
        # sequence-parallel slice of the tokens through them (tensor_parallel.py), as under CP.
        expert_tensor_parallel_size=1,
        moe_grouped_gemm=False,
        add_bias_linear=True,
        gated_linear_unit=True,
        activation_func=gpt_oss_activation(swiglu_alpha),
        glu_linear_offset=1.0,
        activation_func_clamp_value=swiglu_limit,
        bias_activation_fusion=False,
    )
