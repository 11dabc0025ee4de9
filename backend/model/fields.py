"""What the model config says about the architecture, as plain facts: head size, family, the
per-layer window flags, the value head, and ``model_fields`` (our model in the HF mapping's terms,
what import, export and the RL weight stream read). No torch: the config and tools may ask.
"""

from __future__ import annotations

from backend.config.run_values import ffn_size


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


def is_value_head(model_cfg) -> bool:
    """``model.head: value``: a critic's scalar head instead of the vocabulary projection."""
    return getattr(model_cfg, "head", "lm") == "value"
