"""Our model -> a Hugging Face directory: config.json, safetensors weights, tokenizer files.

Pure conversion: it takes our model fields (``backend.config.hf.FIELDS``) and an iterable of
(megatron-core name, full tensor), so the caller decides how full tensors are gathered (one at a
time from FSDP shards, or from a distributed checkpoint); nothing here imports training code.

The config is written with the transformers 4.x keys (``rope_theta``, ``rope_scaling``,
``torch_dtype``) that transformers 5.x still reads, so both load it with no custom code (tested
with 5.24: ``AutoModelForCausalLM.from_pretrained`` gives the same logits). Token ids
(bos/eos/pad) come from the source checkpoint's config.json when one is given. ``vocab_size`` is
the embedding's row count: a model whose vocabulary was padded exports its padded rows.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from backend.config.hf import SUPPORTED_MODEL_TYPES

from .mapping import hf_to_megatron_names
from .safetensors_io import DEFAULT_MAX_SHARD_BYTES, write_sharded

ARCHITECTURES = {
    "qwen3": "Qwen3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}
DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "float32": torch.float32,
    torch.bfloat16: torch.bfloat16,
    torch.float32: torch.float32,
}
#: Copied verbatim when present in the source directory: tokenizer, generation and chat-template
#: files. Never ``*.py`` (custom code) or pickles.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
)
_CARRIED_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"export dtype {name!r}: allowed values are bf16, fp32")
    return DTYPES[name]


def hf_config_dict(fields: dict, *, dtype: str = "bf16", source_config: dict | None = None) -> dict:
    """The config.json for ``fields['model_type']`` (qwen3, llama or qwen2)."""
    model_type = fields["model_type"]
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r}: export supports {', '.join(SUPPORTED_MODEL_TYPES)}")
    if model_type == "gpt_oss":
        return _gpt_oss_config(fields, dtype=dtype, source_config=source_config)
    if fields["qk_layernorm"] != (model_type == "qwen3"):
        raise ValueError(f"qk_layernorm={fields['qk_layernorm']} cannot be expressed as a {model_type} model")
    if fields["qkv_bias"] != (model_type == "qwen2"):
        raise ValueError(f"qkv_bias={fields['qkv_bias']} cannot be expressed as a {model_type} model")
    torch_dtype = str(_dtype(dtype)).removeprefix("torch.")
    cfg = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        **_shape_keys(fields, ffn=fields["ffn_hidden_size"]),
        "rope_theta": float(fields["rotary_base"]),
        "rope_scaling": dict(fields["rope_scaling"]) if fields["rope_scaling"] else None,
        "hidden_act": "silu",
        "tie_word_embeddings": bool(fields["tie_embeddings"]),
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": torch_dtype,
    }
    if model_type in ("llama", "qwen3"):
        cfg["attention_bias"] = False
    if model_type == "llama":
        cfg.update(mlp_bias=False, pretraining_tp=1)
    if model_type in ("qwen2", "qwen3"):
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=fields["num_layers"])
    for key in _CARRIED_KEYS:
        if source_config and source_config.get(key) is not None:
            cfg[key] = source_config[key]
    if fields.get("head") == "value":  # a critic: AutoModelForTokenClassification with one label
        cfg.update(
            architectures=[ARCHITECTURES[model_type].replace("ForCausalLM", "ForTokenClassification")],
            num_labels=1,
            id2label={"0": "LABEL_0"},
            label2id={"LABEL_0": 0},
            tie_word_embeddings=False,
        )
    return cfg


def _shape_keys(fields: dict, *, ffn: int) -> dict:
    """The config.json keys every family shares: widths, depth, heads, vocabulary, positions, norm."""
    return {
        "hidden_size": fields["hidden_size"],
        "intermediate_size": ffn,
        "num_hidden_layers": fields["num_layers"],
        "num_attention_heads": fields["num_attention_heads"],
        "num_key_value_heads": fields["num_query_groups"],
        "head_dim": fields["head_dim"],
        "vocab_size": fields["vocab_size"],
        "max_position_embeddings": fields["max_position_embeddings"],
        "rms_norm_eps": fields["norm_epsilon"],
    }


def _gpt_oss_config(fields: dict, *, dtype: str, source_config: dict | None) -> dict:
    """GPT-OSS config.json: dense weights (no ``quantization_config``), rope_parameters (5.x keys)."""
    scaling = dict(fields["rope_scaling"] or {"rope_type": "default"})
    cfg = {
        "architectures": [ARCHITECTURES["gpt_oss"]],
        "model_type": "gpt_oss",
        **_shape_keys(fields, ffn=fields["moe_ffn_hidden_size"]),
        "rope_parameters": {"rope_theta": float(fields["rotary_base"]), **scaling},
        "tie_word_embeddings": bool(fields["tie_embeddings"]),
        "attention_bias": True,
        "attention_dropout": 0.0,
        "sliding_window": fields["sliding_window"] or None,
        "layer_types": ["sliding_attention" if f else "full_attention" for f in fields["window_attn_skip_freq"]],
        "num_local_experts": fields["num_moe_experts"],
        "num_experts_per_tok": fields["moe_router_topk"],
        "swiglu_limit": fields["swiglu_limit"],
        "router_aux_loss_coef": fields.get("router_aux_loss_coef", 0.0),
        "output_router_logits": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": str(_dtype(dtype)).removeprefix("torch."),
    }
    if fields.get("swiglu_alpha", 1.702) != 1.702:
        raise ValueError(f"swiglu_alpha={fields['swiglu_alpha']}: transformers' GPT-OSS fixes alpha at 1.702")
    for key in _CARRIED_KEYS:
        if source_config and source_config.get(key) is not None:
            cfg[key] = source_config[key]
    return cfg


def hf_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    fields: dict,
    *,
    dtype: str = "bf16",
    device: str | torch.device = "cpu",
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs, cast to ``dtype`` on ``device``, one megatron parameter at a time
    (the files export writes, and the weight stream an RL generator loads: one code path, so the
    two are bitwise equal). ``device="meta"`` gives the shapes and dtypes with no data.

    Every parameter the fields call for must come exactly once: a missing or repeated one is an
    error after the stream ends (naming it), so a partial export never looks complete.
    """
    torch_dtype = _dtype(dtype)
    by_name = {pm.megatron: pm for pm in hf_to_megatron_names(fields)}  # every family, GPT-OSS included
    expected = set(by_name)
    seen: set[str] = set()

    def checked():
        for name, tensor in named_tensors:
            if name.endswith("._extra_state"):
                continue
            if name in seen:
                raise ValueError(f"{name}: given twice")
            if name == "embedding.word_embeddings.weight" and tensor.shape[0] != fields["vocab_size"]:
                raise ValueError(f"{name}: {tensor.shape[0]} rows, but vocab_size={fields['vocab_size']}")
            seen.add(name)
            yield name, tensor

    def to_hf(name, tensor):
        if name not in by_name:
            raise KeyError(f"{name}: no Hugging Face counterpart for this megatron-core parameter")
        return zip(by_name[name].hf, by_name[name].to_hf(tensor), strict=True)

    pairs = ((h, t) for name, tensor in checked() for h, t in to_hf(name, tensor))
    for hf_name, t in pairs:
        yield hf_name, t.detach().to(device, torch_dtype)
    missing = sorted(expected - seen)
    if missing:
        raise ValueError(f"export is missing {len(missing)} parameter(s): {', '.join(missing[:10])}")


def copy_tokenizer_files(source_dir: str | Path, out_dir: str | Path) -> list[str]:
    """Copy the tokenizer / generation / chat-template files present in ``source_dir``."""
    src, out = Path(source_dir), Path(out_dir)
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
            copied.append(name)
    return copied


def export_hf_dir(
    fields: dict,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    out_dir: str | Path,
    *,
    dtype: str = "bf16",
    source_dir: str | Path | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write a complete HF directory; ``source_dir`` (the imported checkpoint) supplies tokenizer
    files and token ids. config.json is written last, so a directory with one is complete."""
    out = Path(out_dir)
    source_config = None
    if source_dir is not None and (Path(source_dir) / "config.json").is_file():
        source_config = json.loads((Path(source_dir) / "config.json").read_text(encoding="utf-8"))
    cfg = hf_config_dict(fields, dtype=dtype, source_config=source_config)
    write_sharded(hf_tensors(named_tensors, fields, dtype=dtype), out, max_shard_bytes)
    if source_dir is not None:
        copy_tokenizer_files(source_dir, out)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return out
