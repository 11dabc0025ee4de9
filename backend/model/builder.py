"""Build megatron-core's ``GPTModel`` (Llama / Qwen3 / Qwen2 style) with our core attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backend.config.run_values import ffn_size, padded_vocab  # noqa: F401  (padded_vocab: re-exported)
from backend.megatron_compat import import_megatron_module

from .attention import AttentionContext, core_attention_spec
from .rope import Rope


def head_dim(model_cfg) -> int:
    """model.head_dim, or hidden_size / num_attention_heads when it is 0."""
    return model_cfg.head_dim or model_cfg.hidden_size // model_cfg.num_attention_heads


def model_family(model_cfg) -> str | None:
    """The Hugging Face family that expresses this architecture: qwen3 (QK norm), qwen2 (QKV bias),
    else llama. Import sets exactly these flags per family, so an imported model maps back to its
    own family; one with both QK norm and QKV bias has no HF counterpart (None)."""
    if model_cfg.qk_layernorm and model_cfg.qkv_bias:
        return None
    return "qwen3" if model_cfg.qk_layernorm else "qwen2" if model_cfg.qkv_bias else "llama"


def model_fields(model_cfg, *, vocab_size: int, max_seq_length: int) -> dict:
    """Our resolved model as ``backend.config.hf.FIELDS`` (what the HF mapping, load and export read)."""
    return {
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
        "tie_embeddings": model_cfg.tie_embeddings,
        "rope_scaling": model_cfg.rope_scaling.to_hf(),
    }


def build_gpt(model_cfg, *, vocab_size: int, max_seq_length: int, backend: str, seed: int):
    """A GPTModel in FP32 (the wrapper moves and casts it). Same seed -> same weights.

    Built on the CPU, or on the meta device when called under ``with torch.device("meta")``
    (storage-free: a Hugging Face import fills the shards afterwards, so a 4B model is never
    randomly initialised in full on every rank; the local spec's CPU init runs on meta tensors).
    """
    te_cfg = import_megatron_module("megatron.core.transformer")
    gpt = import_megatron_module("megatron.core.models.gpt")
    specs = import_megatron_module("megatron.core.models.gpt.gpt_layer_specs")
    config = te_cfg.TransformerConfig(
        num_layers=model_cfg.num_layers,
        hidden_size=model_cfg.hidden_size,
        num_attention_heads=model_cfg.num_attention_heads,
        num_query_groups=model_cfg.num_query_groups,
        ffn_hidden_size=ffn_size(model_cfg),
        kv_channels=head_dim(model_cfg),
        normalization="RMSNorm",
        layernorm_epsilon=float(model_cfg.norm_epsilon),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=model_cfg.qkv_bias,
        qk_layernorm=model_cfg.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=model_cfg.init_method_std,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        # Fusions and CUDA-only paths off: the same modules run on CPU and GPU.
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        cross_entropy_loss_fusion=False,
    )
    spec = specs.get_gpt_layer_local_spec(qk_layernorm=model_cfg.qk_layernorm, normalization="RMSNorm")
    max_positions = model_cfg.max_position_embeddings or max_seq_length
    rope = Rope.from_config(model_cfg, head_dim=config.kv_channels, max_position_embeddings=max_positions)
    spec.submodules.self_attention.submodules.core_attention = core_attention_spec(backend, rope)
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
            share_embeddings_and_output_weights=model_cfg.tie_embeddings,
        )
    finally:
        torch.random.set_rng_state(cpu_state)
    return model


def token_losses(model, tokens, labels, positions, valid, *, cp_group=None) -> torch.Tensor:
    """Per-position cross-entropy [b, s] (FP32), computed by megatron-core from the labels."""
    ctx = AttentionContext(positions=positions, valid=valid, cp_group=cp_group)
    return model(tokens, positions, ctx, labels=labels).float()
