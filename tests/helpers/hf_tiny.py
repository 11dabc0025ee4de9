"""Tiny random Hugging Face models, and our model built from one through ``build_model``.

Nothing is downloaded: models are built from configs with random weights and saved locally.
Sizes: 2 layers, hidden 64, 4 heads, 2 KV heads, vocab 300; Qwen3 uses head_dim 32 so that
head_dim != hidden / heads (16). A tiny byte-level BPE tokenizer (at most 300 ids, a ChatML
chat template) can be saved beside the weights, for chat data and ``data.tokenizer=auto``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

KINDS = ("qwen3", "llama", "qwen2")  # QK norm + tied + head_dim 32; llama3 RoPE + eps 1e-5; QKV bias + YaRN

COMMON = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
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


def tiny_hf_model(kind: str, out_dir, seed: int = 0, *, tokenizer: bool = False):
    """(model in eval mode, FP32, eager attention) saved with save_pretrained to ``out_dir``."""
    import transformers

    cfg = tiny_hf_config(kind)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    randomize(model, seed)
    model.save_pretrained(out_dir)
    if tokenizer:
        save_tiny_tokenizer(out_dir)
    return model


def save_tiny_tokenizer(out_dir, template: str = CHATML) -> Path:
    """A byte-level BPE tokenizer (<= 300 ids) with ChatML specials and ``template`` in ``out_dir``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=290,
        special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["what is two plus two", "four", "assistant user system", "hello world"] * 5, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")
    out = Path(out_dir)
    fast.save_pretrained(out)
    (out / "chat_template.jinja").write_text(template)
    return out


def hf_overrides(hf_dir, *extra: str) -> list[str]:
    """Dotted overrides that build our model from ``hf_dir`` in FP32 with SDPA on the CPU."""
    return [
        f"model.hf_checkpoint={hf_dir}",
        "model.attention_backend=sdpa",
        "train.precision=fp32",
        "data.max_seq_length=256",
        "data.tokenizer=byte",
        *extra,
    ]


def build_from_hf(hf_dir, env, *extra: str, training: bool = False):
    """Our model (``build_model``, FSDP2 over ``env``'s world) with ``hf_dir``'s weights."""
    from backend.config import load_config, validate
    from backend.model.factory import build_model

    cfg = validate(load_config(None, hf_overrides(hf_dir, *extra)), env.world_size)
    return build_model(cfg, env, tokenizer_vocab=256, training=training)


def our_logits(model, tokens: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[b, s, vocab] logits of a right-padded batch (positions 0.. per row)."""
    from backend.model.attention import AttentionContext

    positions = torch.arange(tokens.shape[1])[None].expand_as(tokens).contiguous()
    with torch.no_grad():
        return model(tokens, positions, AttentionContext(positions=positions, valid=valid))


def hf_logits(model, tokens: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens, attention_mask=valid.long()).logits


def right_padded_batch(lengths=(17, 9, 30, 1), vocab=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = max(lengths)
    tokens = torch.randint(0, vocab, (len(lengths), s), generator=g)
    valid = torch.arange(s)[None] < torch.tensor(lengths)[:, None]
    return tokens.masked_fill(~valid, 0), valid


def tiny_gpt_oss_config():
    """GPT-OSS: 2 layers (sliding window 4, then full), 4 experts top 2, sinks, biases, YaRN (truncate false)."""
    import transformers

    return transformers.GptOssConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        router_aux_loss_coef=0.9,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 8,  # 256 / 32: YaRN interpolates past position 8
        },
    )


def tiny_gpt_oss_model(out_dir, seed: int = 0):
    """A tiny random GPT-OSS (FP32, eager attention) saved with save_pretrained to ``out_dir``."""
    import transformers

    cfg = tiny_gpt_oss_config()
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(cfg).float().eval()
    randomize(model, seed)
    with torch.no_grad():  # sinks of order 1 and router logits spread enough that top-2 is not a tie
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.linspace(-1.0, 1.5, layer.self_attn.sinks.numel()))
            layer.mlp.router.weight.mul_(10.0)
    model.save_pretrained(out_dir)
    return model


def write_mxfp4_copy(src: Path, dst: Path, seed: int = 0) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``src`` with its dense expert matrices replaced by random MXFP4 blocks/scales (+ quantization_config)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    files = sorted(dst.glob("*.safetensors"))
    assert len(files) == 1
    state = load_file(files[0])
    g = torch.Generator().manual_seed(seed)
    pairs = {}
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, rows_in, cols_out = state.pop(name).shape  # dense [E, in, out]
        blocks = torch.randint(0, 256, (e, cols_out, rows_in // 32, 16), generator=g, dtype=torch.uint8)
        scales = torch.randint(118, 124, (e, cols_out, rows_in // 32), generator=g, dtype=torch.uint8)
        state[f"{name}_blocks"], state[f"{name}_scales"] = blocks, scales
        pairs[name] = (blocks, scales)
    save_file(state, files[0], metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (dst / "config.json").write_text(json.dumps(cfg))
    return pairs
