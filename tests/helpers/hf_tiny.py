"""Tiny random Hugging Face models and a matching megatron-core GPTModel, for the HF tests.

Nothing is downloaded: models are built from configs with random weights and saved locally.
Sizes: 2 layers, hidden 64, 4 heads, 2 KV heads, vocab 300; Qwen3 uses head_dim 32 so that
head_dim != hidden / heads (16).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from backend.megatron_compat import import_megatron_module
from backend.model.attention import AttentionContext, core_attention_spec
from backend.model.hf.rope import cos_sin, inv_freq
from backend.model.rope import Rope

COMMON = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def tiny_hf_config(kind: str):
    import transformers

    if kind == "qwen3":
        return transformers.Qwen3Config(
            **COMMON,
            head_dim=32,
            tie_word_embeddings=True,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        )
    if kind == "llama":
        return transformers.LlamaConfig(
            **COMMON,
            tie_word_embeddings=False,
            rms_norm_eps=1e-5,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500_000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    if kind == "qwen2":
        return transformers.Qwen2Config(
            **COMMON,
            tie_word_embeddings=False,
            rms_norm_eps=1e-6,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    raise ValueError(kind)


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Weights far from init (norms around 1, biases nonzero) so every mapping error shows."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.copy_(0.5 + torch.rand(p.shape, generator=g))
        else:
            p.copy_(0.08 * torch.randn(p.shape, generator=g))


def tiny_hf_model(kind: str, out_dir, seed: int = 0):
    """(model in eval mode, FP32, eager attention) saved with save_pretrained to ``out_dir``."""
    import transformers

    cfg = tiny_hf_config(kind)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    randomize(model, seed)
    model.save_pretrained(out_dir)
    return model


@dataclass
class RopeContext(AttentionContext):
    """AttentionContext whose RoPE uses given inverse frequencies and attention factor (scaled RoPE)."""

    inv_freq: torch.Tensor | None = None
    attention_factor: float = 1.0

    def rope(self, rope: Rope, dtype: torch.dtype):
        key = ("rope", rope.head_dim, dtype)
        if key not in self._cache:
            cos, sin = cos_sin(self.positions.t(), self.inv_freq, self.attention_factor, dtype)  # [s, b, d]
            self._cache[key] = (cos[:, :, None, :], sin[:, :, None, :])
        return self._cache[key]


def build_megatron(fields: dict, backend: str = "sdpa"):
    """A GPTModel (local spec, FP32, CPU) with the architecture ``fields`` describe."""
    tc = import_megatron_module("megatron.core.transformer")
    gpt = import_megatron_module("megatron.core.models.gpt")
    specs = import_megatron_module("megatron.core.models.gpt.gpt_layer_specs")
    config = tc.TransformerConfig(
        num_layers=fields["num_layers"],
        hidden_size=fields["hidden_size"],
        num_attention_heads=fields["num_attention_heads"],
        num_query_groups=fields["num_query_groups"],
        kv_channels=fields["head_dim"],
        ffn_hidden_size=fields["ffn_hidden_size"],
        normalization="RMSNorm",
        layernorm_epsilon=fields["norm_epsilon"],
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=fields["qkv_bias"],
        qk_layernorm=fields["qk_layernorm"],
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        cross_entropy_loss_fusion=False,
    )
    spec = specs.get_gpt_layer_local_spec(qk_layernorm=fields["qk_layernorm"], normalization="RMSNorm")
    rope = Rope(head_dim=fields["head_dim"], base=float(fields["rotary_base"]))  # RopeContext supplies the scaling
    spec.submodules.self_attention.submodules.core_attention = core_attention_spec(backend, rope)
    return gpt.GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=fields["vocab_size"],
        max_sequence_length=fields["max_position_embeddings"],
        position_embedding_type="none",
        share_embeddings_and_output_weights=fields["tie_embeddings"],
    ).eval()


def megatron_logits(model, fields: dict, tokens: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[b, s, vocab] logits of a right-padded batch (positions 0.. per row)."""
    positions = torch.arange(tokens.shape[1])[None].expand_as(tokens).contiguous()
    inv, factor = inv_freq(
        fields["head_dim"],
        fields["rotary_base"],
        fields["rope_scaling"],
        max_position_embeddings=fields["max_position_embeddings"],
    )
    ctx = RopeContext(positions=positions, valid=valid, inv_freq=inv, attention_factor=factor)
    return model(tokens, positions, ctx)


def right_padded_batch(lengths=(17, 9, 30, 1), vocab=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = max(lengths)
    tokens = torch.randint(0, vocab, (len(lengths), s), generator=g)
    valid = torch.arange(s)[None] < torch.tensor(lengths)[:, None]
    return tokens.masked_fill(~valid, 0), valid
