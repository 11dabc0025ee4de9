"""Build megatron-core's ``GPTModel`` (Llama / Qwen3 style) with our core attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backend.megatron_compat import import_megatron_module

from .attention import AttentionContext, core_attention_spec
from .rope import Rope


def ffn_size(model_cfg) -> int:
    if model_cfg.ffn_hidden_size:
        return model_cfg.ffn_hidden_size
    return -(-int(8 * model_cfg.hidden_size / 3) // 64) * 64


def padded_vocab(model_cfg, tokenizer_vocab: int) -> int:
    """model.vocab_size, or the tokenizer's rounded up to a multiple of 128 (GEMM-friendly)."""
    if model_cfg.vocab_size:
        if model_cfg.vocab_size < tokenizer_vocab:
            raise ValueError(f"model.vocab_size={model_cfg.vocab_size} is below the tokenizer's {tokenizer_vocab} ids")
        return model_cfg.vocab_size
    return -(-tokenizer_vocab // 128) * 128


def build_gpt(model_cfg, *, vocab_size: int, max_seq_length: int, backend: str, seed: int):
    """A GPTModel on the CPU in FP32 (the wrapper moves and casts it). Same seed -> same weights."""
    te_cfg = import_megatron_module("megatron.core.transformer")
    gpt = import_megatron_module("megatron.core.models.gpt")
    specs = import_megatron_module("megatron.core.models.gpt.gpt_layer_specs")
    config = te_cfg.TransformerConfig(
        num_layers=model_cfg.num_layers,
        hidden_size=model_cfg.hidden_size,
        num_attention_heads=model_cfg.num_attention_heads,
        num_query_groups=model_cfg.num_query_groups,
        ffn_hidden_size=ffn_size(model_cfg),
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
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
    rope = Rope(head_dim=config.kv_channels, base=float(model_cfg.rotary_base))
    spec.submodules.self_attention.submodules.core_attention = core_attention_spec(backend, rope)
    cpu_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = gpt.GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=vocab_size,
            max_sequence_length=model_cfg.max_position_embeddings or max_seq_length,
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
