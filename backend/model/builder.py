"""Build megatron-core's ``GPTModel`` (Llama / Qwen3 / Qwen2 / GPT-OSS style) with our core attention.

GPT-OSS (``model.num_moe_experts`` > 0, ``attention_sinks``, ``sliding_window``): megatron-core's
MoE layer on its CPU-safe path (``moe_compat``: TopKRouter, allgather dispatcher) with our stacked
``grouped_experts`` in its experts slot (biases and the clamped SwiGLU, grouped GEMMs), ``softmax_type="learnable"`` (our core attention
holds the sinks as ``softmax_offset``), ``window_size=(W - 1, 0)`` with a per-layer
``window_attn_skip_freq`` list. megatron-core's own load-balancing loss is off: the aux loss is
ours, per sequence and normalised per window (``moe_stats``), so fixed and dynamic plans agree.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backend.config.run_values import ffn_size, padded_vocab  # noqa: F401  (padded_vocab: re-exported)
from backend.megatron_compat import import_megatron_module

from .attention import AttentionContext, core_attention_spec
from .output import OutputRequest, output_request
from .rope import Rope

# Fusions and CUDA-only paths off: the same megatron-core modules run on CPU and GPU.
PORTABLE_FUSIONS_OFF = dict(
    masked_softmax_fusion=False,
    bias_dropout_fusion=False,
    apply_rope_fusion=False,
    persist_layer_norm=False,
    gradient_accumulation_fusion=False,
    cross_entropy_loss_fusion=False,
)


def head_dim(model_cfg) -> int:
    """model.head_dim, or hidden_size / num_attention_heads when it is 0."""
    return model_cfg.head_dim or model_cfg.hidden_size // model_cfg.num_attention_heads


def is_gpt_oss(model_cfg) -> bool:
    """Experts, sinks, windows or o_proj biases: only the gpt_oss family expresses them."""
    return bool(
        model_cfg.num_moe_experts or model_cfg.attention_sinks or model_cfg.sliding_window or model_cfg.attention_bias
    )


def layer_flags(model_cfg) -> list[int]:
    """1 (sliding) / 0 (full) per layer; every layer slides when the list is empty."""
    return list(model_cfg.window_attn_skip_freq) or [1] * model_cfg.num_layers


def model_family(model_cfg) -> str | None:
    """The Hugging Face family that expresses this architecture: qwen3 (QK norm), qwen2 (QKV bias),
    else llama. Import sets exactly these flags per family, so an imported model maps back to its
    own family; one with both QK norm and QKV bias has no HF counterpart (None)."""
    if is_gpt_oss(model_cfg):
        return "gpt_oss"
    if model_cfg.qk_layernorm and model_cfg.qkv_bias:
        return None
    return "qwen3" if model_cfg.qk_layernorm else "qwen2" if model_cfg.qkv_bias else "llama"


def model_fields(model_cfg, *, vocab_size: int, max_seq_length: int) -> dict:
    """Our resolved model as ``backend.config.hf.FIELDS`` (what the HF mapping, load and export read)."""
    fields = {
        "model_type": model_family(model_cfg),
        "num_layers": model_cfg.num_layers,
        "hidden_size": model_cfg.hidden_size,
        "num_attention_heads": model_cfg.num_attention_heads,
        "num_query_groups": model_cfg.num_query_groups,
        "ffn_hidden_size": ffn_size(model_cfg),
        "vocab_size": vocab_size,
        "max_position_embeddings": model_cfg.max_position_embeddings or max_seq_length,
        "rotary_base": float(model_cfg.rotary_base),
        "head_dim": head_dim(model_cfg),
        "norm_epsilon": float(model_cfg.norm_epsilon),
        "qk_layernorm": model_cfg.qk_layernorm,
        "qkv_bias": model_cfg.qkv_bias,
        "tie_embeddings": model_cfg.tie_embeddings and not is_value_head(model_cfg),
        "rope_scaling": model_cfg.rope_scaling.to_hf(),
    }
    if is_value_head(model_cfg):
        fields["head"] = "value"  # the HF mapping's score.weight / score.bias, a token-classification export
    if is_gpt_oss(model_cfg):
        fields.update(
            attention_bias=model_cfg.attention_bias,
            attention_sinks=model_cfg.attention_sinks,
            sliding_window=model_cfg.sliding_window,
            window_attn_skip_freq=layer_flags(model_cfg),
            num_moe_experts=model_cfg.num_moe_experts,
            moe_router_topk=model_cfg.moe_router_topk,
            moe_ffn_hidden_size=model_cfg.moe_ffn_hidden_size or ffn_size(model_cfg),
            swiglu_alpha=float(model_cfg.swiglu_alpha),
            swiglu_limit=float(model_cfg.swiglu_limit),
            router_aux_loss_coef=float(model_cfg.moe_aux_loss_coeff),
        )
    return fields


def build_gpt(model_cfg, *, vocab_size: int, max_seq_length: int, backend: str, seed: int):
    """A GPTModel in FP32 (the wrapper moves and casts it). Same seed -> same weights.

    Built on the CPU, or on the meta device when called under ``with torch.device("meta")``
    (storage-free: a Hugging Face import fills the shards afterwards, so a 4B model is never
    randomly initialised in full on every rank; the local spec's CPU init runs on meta tensors).
    """
    te_cfg = import_megatron_module("megatron.core.transformer")
    gpt = import_megatron_module("megatron.core.models.gpt")
    specs = import_megatron_module("megatron.core.models.gpt.gpt_layer_specs")
    kwargs = dict(
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=model_cfg.qkv_bias,
        bias_activation_fusion=False,
    )
    experts = model_cfg.num_moe_experts
    if experts:
        from .moe_compat import apply_moe_compat, moe_config_kwargs

        apply_moe_compat()
        kwargs |= moe_config_kwargs(
            num_experts=experts,
            topk=model_cfg.moe_router_topk,
            moe_ffn_hidden_size=model_cfg.moe_ffn_hidden_size or ffn_size(model_cfg),
            swiglu_limit=model_cfg.swiglu_limit,
            swiglu_alpha=model_cfg.swiglu_alpha,
            aux_loss_coeff=0.0,  # ours instead (moe_stats): per sequence, normalised per window
        )
    if model_cfg.attention_bias:
        if not experts:
            raise ValueError("model.attention_bias without experts: megatron-core would bias the dense MLP too")
        kwargs |= dict(add_bias_linear=True, add_qkv_bias=True)
    if model_cfg.attention_sinks:
        kwargs["softmax_type"] = "learnable"
    if model_cfg.sliding_window:
        kwargs |= dict(window_size=(model_cfg.sliding_window - 1, 0), window_attn_skip_freq=layer_flags(model_cfg))
    if "cuda_graph_scope" in te_cfg.TransformerConfig.__dataclass_fields__:
        # Its default "full" is deprecated and warns on every build; [] is the same (no graphs here).
        kwargs["cuda_graph_scope"] = []
    config = te_cfg.TransformerConfig(
        num_layers=model_cfg.num_layers,
        hidden_size=model_cfg.hidden_size,
        num_attention_heads=model_cfg.num_attention_heads,
        num_query_groups=model_cfg.num_query_groups,
        ffn_hidden_size=ffn_size(model_cfg),
        kv_channels=head_dim(model_cfg),
        normalization="RMSNorm",
        layernorm_epsilon=float(model_cfg.norm_epsilon),
        qk_layernorm=model_cfg.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=model_cfg.init_method_std,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        **PORTABLE_FUSIONS_OFF,
        **kwargs,
    )
    spec = specs.get_gpt_layer_local_spec(
        num_experts=experts or None,
        moe_grouped_gemm=False,
        qk_layernorm=model_cfg.qk_layernorm,
        normalization="RMSNorm",
    )
    max_positions = model_cfg.max_position_embeddings or max_seq_length
    rope = Rope.from_config(model_cfg, head_dim=config.kv_channels, max_position_embeddings=max_positions)
    spec.submodules.self_attention.submodules.core_attention = core_attention_spec(backend, rope)
    if experts:  # stacked experts, one grouped GEMM per projection (grouped_experts), not SequentialMLP
        from .grouped_experts import experts_spec

        spec.submodules.mlp.submodules.experts = experts_spec()
    cpu_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = gpt.GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=vocab_size,
            max_sequence_length=max_positions,
            # RoPE is applied inside our core attention from global positions (CP-safe, CPU-safe).
            position_embedding_type="none",
            share_embeddings_and_output_weights=model_cfg.tie_embeddings and not is_value_head(model_cfg),
        )
        if is_value_head(model_cfg):
            # A critic: a scalar head (hidden -> 1, with a bias, as transformers' token
            # classification ``score``) in place of the vocabulary projection; same name, so the
            # output path and FSDP2 wrapping are unchanged. Weight ~ N(0, init_method_std), bias 0.
            tensor_parallel = import_megatron_module("megatron.core.tensor_parallel")
            model.output_layer = tensor_parallel.ColumnParallelLinear(
                config.hidden_size,
                1,
                config=config,
                init_method=config.init_method,
                bias=True,
                skip_bias_add=False,
                gather_output=False,
            )
    finally:
        torch.random.set_rng_state(cpu_state)
    if experts:
        from .moe_stats import install

        install(model, model_cfg.moe_aux_loss_coeff)
    return model


def _forward(model, tokens, labels, positions, valid, *, cp_group, route_rows, segments):
    """The model on one microbatch: per-position cross-entropy [b, s] with ``labels``, else logits [b, s, V]."""
    ctx = AttentionContext(positions=positions, valid=valid, cp_group=cp_group, **(segments or {}))
    if getattr(model, "_moe_routers", None):
        from .moe_stats import routing_context

        groups = segments["segment_ids"] if segments else None
        with routing_context(model, valid, cp_group=cp_group, rows=route_rows, groups=groups):
            return model(tokens, positions, ctx, labels=labels, padding_mask=~valid)
    return model(tokens, positions, ctx, labels=labels)


def token_losses(
    model,
    tokens,
    labels,
    positions,
    valid,
    *,
    cp_group=None,
    route_rows=None,
    segments: dict | None = None,
    grad_hint: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-position cross-entropy [b, s] (FP32), computed by megatron-core from the labels.

    MoE models also get ``padding_mask`` (True at padding, megatron-core's convention), so padding
    never enters megatron-core's own router bookkeeping; ours (``moe_stats``) reads ``valid`` and
    ``route_rows`` (one bool per sample: False for samples that must not count, the zero-weight
    placeholder). ``segments`` (packed rows): ``segment_ids``, ``cu_seqlens``, ``cu_seqlens_padded``
    for the attention context, so attention stays within each packed sequence, and the router
    statistics are per packed sequence (a sample), as they are per row when padded.
    """
    if getattr(model, "_logits_chunk_tokens", 0) or getattr(model, "_vocab_limit", None):
        # chunked logits, or a padded vocabulary kept out of the softmax: through log p (the same
        # number as megatron-core's cross-entropy to FP32 rounding)
        lp, _ = token_logprobs(
            model,
            tokens,
            labels,
            positions,
            valid,
            cp_group=cp_group,
            route_rows=route_rows,
            segments=segments,
            grad_hint=None if grad_hint is None else -grad_hint,  # the losses are -log p
        )
        return -lp
    return _forward(
        model, tokens, labels, positions, valid, cp_group=cp_group, route_rows=route_rows, segments=segments
    ).float()


def is_value_head(model_cfg) -> bool:
    """``model.head: value``: a critic's scalar head instead of the vocabulary projection."""
    return getattr(model_cfg, "head", "lm") == "value"


def token_values(model, tokens, positions, valid, *, cp_group=None, route_rows=None, segments=None) -> torch.Tensor:
    """A critic's value at each position [b, s] (FP32): the head's output on the position's hidden
    state, so entry i values the state before token i + 1 (aligned like the labels)."""
    out = _forward(model, tokens, None, positions, valid, cp_group=cp_group, route_rows=route_rows, segments=segments)
    return out[..., 0].float()


def token_logits(model, tokens, positions, valid, *, cp_group=None, route_rows=None, segments=None) -> torch.Tensor:
    """The model's logits [b, s, V] (in the compute dtype) for one microbatch."""
    return _forward(model, tokens, None, positions, valid, cp_group=cp_group, route_rows=route_rows, segments=segments)


def token_logprobs(
    model,
    tokens,
    labels,
    positions,
    valid,
    *,
    entropy: str = "",
    cp_group=None,
    route_rows=None,
    segments: dict | None = None,
    temperature: float = 1.0,
    grad_hint: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(label), full-vocabulary entropy or None), each [b, s] in FP32, from the logits.
    ``entropy``: "" (not computed), "value" (no gradient: a metric; autograd keeps no softmax
    for it) or "grad" (differentiable: an entropy bonus in the loss). ``temperature``: the logits
    are divided by it first (``loss.temperature``: the sampler's, as verl, NeMo-RL and OpenRLHF
    do), so log p and H are those of the distribution the sampler drew from; 1 skips the division.

    The policy loss needs both, and the entropy needs every logit, so this path asks the model for
    logits (megatron-core's labels path returns only the cross-entropy). lp = logit[label] -
    logsumexp(logits) is the same number as -cross-entropy to FP32 rounding; H = logsumexp -
    sum(softmax * logits). Memory: one FP32 copy of the logits (and its softmax when H is wanted),
    unless the model was built with ``model.logits_chunk_tokens`` (``backend.model.output``: a
    chunk's logits at a time). ``model._vocab_limit`` (the tokenizer's vocabulary when we padded
    the embedding) keeps padding rows out of the softmax and the entropy on either path.
    """
    chunk, limit = getattr(model, "_logits_chunk_tokens", 0), getattr(model, "_vocab_limit", None)
    if chunk:
        request = OutputRequest(labels, chunk, temperature, entropy, limit, grad_hint)
        with output_request(model, request):
            out = _forward(
                model, tokens, None, positions, valid, cp_group=cp_group, route_rows=route_rows, segments=segments
            )
        return out[..., 0], (out[..., 1] if entropy else None)
    logits = token_logits(model, tokens, positions, valid, cp_group=cp_group, route_rows=route_rows, segments=segments)
    logits = logits.float()
    if limit:
        logits = logits[..., :limit]
    if temperature != 1.0:
        logits = logits / temperature
    norm = torch.logsumexp(logits, dim=-1)
    lp = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - norm
    if not entropy:
        return lp, None
    with torch.set_grad_enabled(entropy == "grad" and torch.is_grad_enabled()):
        return lp, norm - (torch.softmax(logits, dim=-1) * logits).sum(-1)
