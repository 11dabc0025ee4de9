"""A Hugging Face ``config.json`` -> our model fields, refusing what the model cannot express.

Our model is megatron-core's GPTModel with the local layer spec: RMSNorm, SwiGLU, RoPE, grouped-
query attention, optional QK RMSNorm and optional bias on the fused QKV projection only. A HF
setting outside that (another activation, biases on the output or MLP projections, sliding-window
layers, an unsupported RoPE type, attention dropout) would give an imported model whose logits
differ from the checkpoint's without any error, so every such field is refused by name, with the
file. Harmless bookkeeping keys (bos/eos ids, ``use_cache``, ``dtype``, ...) are ignored.

Decisions, for the record:

- ``attention_bias: true`` (Llama, Qwen3) puts a bias on q, k, v AND o_proj; megatron-core can
  add a bias to the QKV projection alone (``add_qkv_bias``) but an o_proj bias only together with
  MLP biases (``add_bias_linear``), so it is refused. Qwen2 always has q/k/v biases and no o_proj
  bias: that is ``qkv_bias: True``.
- ``attention_dropout`` other than 0.0 is refused: training would silently skip it (our core
  attention has no dropout). Every released Qwen2/Qwen3/Llama checkpoint has 0.0.
- ``sliding_window`` is a number in many Qwen2.5 configs (131072) but only used when
  ``use_sliding_window`` is true (or ``layer_types`` names ``sliding_attention``): only those
  are refused.
- The vocabulary is the checkpoint's ``vocab_size`` exactly (no padding to a multiple of 128):
  the embedding rows are the checkpoint's, and export writes the same shape back.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

#: rope_type values ``backend.model.hf.rope`` reproduces; others (dynamic, longrope, ...) are refused.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

#: HF ``model_type`` values this backend imports and exports.
SUPPORTED_MODEL_TYPES = ("qwen3", "llama", "qwen2", "gpt_oss")

#: Our model fields, in the order ``read_hf_config`` returns them.
FIELDS = (
    "model_type",
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "ffn_hidden_size",
    "vocab_size",
    "max_position_embeddings",
    "rotary_base",
    "head_dim",
    "norm_epsilon",
    "qk_layernorm",
    "qkv_bias",
    "tie_embeddings",
    "rope_scaling",
)

# Keys each scaled RoPE type must carry (transformers indexes them without defaults).
_ROPE_REQUIRED = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("original_max_position_embeddings",),
}


#: The weight files of a Hugging Face directory we read (safetensors only: never a pickle).
SAFETENSORS_SINGLE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


def weights_problem(hf_dir: str | Path) -> str | None:
    """Why ``hf_dir`` has no weights we would read (None when it has ``model.safetensors`` or a
    sharded index): checked where the config is resolved, so a ``.bin``-only directory is one
    error line from ``--print-config`` instead of a traceback after the model is built."""
    d = Path(hf_dir)
    if (d / SAFETENSORS_INDEX).is_file() or (d / SAFETENSORS_SINGLE).is_file():
        return None
    pickles = sorted(p.name for p in d.glob("*.bin")) + sorted(p.name for p in d.glob("*.pt"))
    if pickles:
        return (
            f"{d}: safetensors only: never unpickles .bin ({', '.join(pickles)}); convert it with a trusted tool "
            f"to {SAFETENSORS_SINGLE} first (transformers: AutoModelForCausalLM.from_pretrained(DIR)"
            ".save_pretrained(NEW_DIR))"
        )
    return f"{d}: no {SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX} in this directory"


class HFConfigError(ValueError):
    """A config.json this backend cannot represent faithfully; the message names the field and file."""


def read_hf_config(hf_dir: str | Path) -> dict:
    """Our model fields from ``hf_dir/config.json`` (see ``FIELDS``)."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise HFConfigError(f"{path}: no config.json in the Hugging Face directory")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise HFConfigError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(cfg, dict):
        raise HFConfigError(f"{path}: expected a JSON object")
    return fields_from_hf(cfg, source=str(path))


def _attention_shape(cfg: dict, source: str) -> tuple[int, int, int, int]:
    """(hidden, heads, kv heads, head_dim) from config.json; kv heads must divide heads."""
    hidden = _need(cfg, "hidden_size", source)
    heads = _need(cfg, "num_attention_heads", source)
    kv = cfg.get("num_key_value_heads") or heads
    if heads % kv:
        raise HFConfigError(f"{source}: 'num_key_value_heads' = {kv} must divide 'num_attention_heads' = {heads}")
    return hidden, heads, kv, cfg.get("head_dim") or hidden // heads


def _need(cfg: dict, key: str, source: str, kind=int):
    if key not in cfg or cfg[key] is None:
        raise HFConfigError(f"{source}: required field '{key}' is missing")
    value = cfg[key]
    if kind is int and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
        raise HFConfigError(f"{source}: '{key}' must be a positive integer, got {value!r}")
    if kind is float and (isinstance(value, bool) or not isinstance(value, int | float) or value <= 0):
        raise HFConfigError(f"{source}: '{key}' must be a positive number, got {value!r}")
    return value


def _refuse_unless(cfg: dict, key: str, allowed, source: str, why: str) -> None:
    """Refuse ``key`` when present with a value outside ``allowed`` (a tuple of accepted values)."""
    if key in cfg and cfg[key] not in allowed:
        shown = " or ".join(repr(a) for a in allowed)
        raise HFConfigError(f"{source}: '{key}' = {cfg[key]!r} is not supported ({why}; supported: {shown})")


def _rope(cfg: dict, source: str) -> tuple[float, dict | None]:
    """(rope theta, scaling dict or None) from either the 4.x keys or 5.x ``rope_parameters``."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "rope_type" not in params and "rope_theta" not in params:
        raise HFConfigError(f"{source}: 'rope_parameters' per layer type is not supported")
    scaling = dict(params) if isinstance(params, dict) else dict(cfg.get("rope_scaling") or {})
    theta = scaling.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0
    if isinstance(theta, bool) or not isinstance(theta, int | float) or theta <= 1:
        raise HFConfigError(f"{source}: 'rope_theta' must be a number above 1, got {theta!r}")
    partial = scaling.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise HFConfigError(
            f"{source}: 'partial_rotary_factor' = {partial!r} is not supported (RoPE on the whole head only)"
        )
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    scaling.pop("type", None)
    rope_type = scaling.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise HFConfigError(
            f"{source}: rope_type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if rope_type == "default":
        return float(theta), None
    for key in _ROPE_REQUIRED[rope_type]:
        if scaling.get(key) is None:
            raise HFConfigError(f"{source}: rope_type {rope_type!r} needs '{key}' in its RoPE parameters")
    return float(theta), scaling


#: GPT-OSS-only fields ``gpt_oss_fields`` adds to ``config.FIELDS``.
GPT_OSS_FIELDS = (
    "attention_bias",
    "attention_sinks",
    "sliding_window",
    "window_attn_skip_freq",
    "num_moe_experts",
    "moe_router_topk",
    "moe_ffn_hidden_size",
    "swiglu_alpha",
    "swiglu_limit",
    "router_aux_loss_coef",
)


def gpt_oss_fields(cfg: dict, source: str = "config.json") -> dict:
    """Our model fields from a GPT-OSS config.json dict (``config.FIELDS`` + ``GPT_OSS_FIELDS``).

    ``layer_types`` becomes megatron-core's ``window_attn_skip_freq`` as a per-layer list (1 =
    sliding window of ``sliding_window`` keys, 0 = full); ``window_size`` for megatron-core is
    ``(sliding_window - 1, 0)``. A ``quantization_config`` of ``quant_method: mxfp4`` is accepted
    (the loader dequantises experts with ``mxfp4``); any other quantisation is refused.
    """
    if cfg.get("model_type") != "gpt_oss":
        raise HFConfigError(f"{source}: model_type {cfg.get('model_type')!r} is not gpt_oss")
    quant = cfg.get("quantization_config")
    if quant and quant.get("quant_method") != "mxfp4":
        raise HFConfigError(f"{source}: quantization {quant.get('quant_method')!r} is not supported (mxfp4 only)")
    if cfg.get("attention_dropout", 0.0) not in (0, 0.0, None):
        raise HFConfigError(f"{source}: 'attention_dropout' must be 0 (training applies no attention dropout)")
    if not cfg.get("attention_bias", True):
        raise HFConfigError(f"{source}: 'attention_bias' = false is not supported (GPT-OSS biases q, k, v and o)")
    layers = _need(cfg, "num_hidden_layers", source)
    hidden, heads, kv, head_dim = _attention_shape(cfg, source)
    layer_types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)
    ]
    if len(layer_types) != layers or set(layer_types) - {"sliding_attention", "full_attention"}:
        raise HFConfigError(f"{source}: 'layer_types' must list sliding_attention/full_attention for each layer")
    window = cfg.get("sliding_window") or 0
    if "sliding_attention" in layer_types and window <= 0:
        raise HFConfigError(f"{source}: sliding_attention layers need a positive 'sliding_window'")
    experts = _need(cfg, "num_local_experts", source)
    topk = _need(cfg, "num_experts_per_tok", source)
    if topk > experts:
        raise HFConfigError(f"{source}: 'num_experts_per_tok' = {topk} exceeds 'num_local_experts' = {experts}")
    theta, scaling = _rope(cfg, source)
    inter = _need(cfg, "intermediate_size", source)
    return {
        "model_type": "gpt_oss",
        "num_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_query_groups": kv,
        "ffn_hidden_size": inter,
        "vocab_size": _need(cfg, "vocab_size", source),
        "max_position_embeddings": _need(cfg, "max_position_embeddings", source),
        "rotary_base": theta,
        "head_dim": head_dim,
        "norm_epsilon": float(_need(cfg, "rms_norm_eps", source, float)),
        "qk_layernorm": False,
        "qkv_bias": True,
        "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "rope_scaling": scaling,
        "attention_bias": True,
        "attention_sinks": True,
        "sliding_window": int(window),
        "window_attn_skip_freq": [1 if t == "sliding_attention" else 0 for t in layer_types],
        "num_moe_experts": experts,
        "moe_router_topk": topk,
        "moe_ffn_hidden_size": inter,
        "swiglu_alpha": float(cfg.get("swiglu_alpha", 1.702)),
        "swiglu_limit": float(cfg.get("swiglu_limit", 7.0)),
        "router_aux_loss_coef": float(cfg.get("router_aux_loss_coef", 0.0)),
    }


def fields_from_hf(cfg: dict, source: str = "config.json") -> dict:
    """Translate a parsed config.json; ``source`` names the file in errors."""
    model_type = cfg.get("model_type")
    if model_type == "gpt_oss":
        return gpt_oss_fields(cfg, source)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise HFConfigError(
            f"{source}: model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    if cfg.get("quantization_config"):
        raise HFConfigError(f"{source}: 'quantization_config' is set: quantized checkpoints are not supported")
    act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
    if act != "silu":
        raise HFConfigError(f"{source}: 'hidden_act' = {act!r} is not supported (the MLP is SwiGLU: silu only)")
    _refuse_unless(cfg, "mlp_bias", (False, None), source, "the MLP projections have no bias")
    _refuse_unless(cfg, "attention_bias", (False, None), source, "megatron-core cannot bias o_proj alone")
    _refuse_unless(cfg, "use_sliding_window", (False, None), source, "attention is full causal in every layer")
    _refuse_unless(cfg, "attention_dropout", (0, 0.0, None), source, "training applies no attention dropout")
    _refuse_unless(cfg, "pretraining_tp", (1, None), source, "tensor-parallel pretraining slices")
    layer_types = cfg.get("layer_types") or []
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other:
        raise HFConfigError(f"{source}: 'layer_types' holds {other} (only 'full_attention' layers are supported)")

    hidden, heads, kv, head_dim = _attention_shape(cfg, source)
    if cfg.get("head_dim") is None and hidden % heads:
        raise HFConfigError(f"{source}: 'hidden_size' = {hidden} is not a multiple of 'num_attention_heads' = {heads}")
    if head_dim % 2:
        raise HFConfigError(f"{source}: 'head_dim' = {head_dim} must be even for RoPE")
    theta, scaling = _rope(cfg, source)
    eps = _need(cfg, "rms_norm_eps", source, float)
    return {
        "model_type": model_type,
        "num_layers": _need(cfg, "num_hidden_layers", source),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_query_groups": kv,
        "ffn_hidden_size": _need(cfg, "intermediate_size", source),
        "vocab_size": _need(cfg, "vocab_size", source),
        "max_position_embeddings": _need(cfg, "max_position_embeddings", source),
        "rotary_base": theta,
        "head_dim": head_dim,
        "norm_epsilon": float(eps),
        "qk_layernorm": model_type == "qwen3",
        "qkv_bias": model_type == "qwen2",
        # Llama, Qwen2 and Qwen3 configs all default to untied when the key is absent.
        "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "rope_scaling": scaling,
    }


def _same(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return math.isclose(float(a), float(b), rel_tol=1e-12, abs_tol=0.0)
    return a == b


def check_against_explicit(hf_fields: dict, explicit: dict, *, source: str = "config.json") -> None:
    """Refuse user-set model keys that contradict the checkpoint's config.

    ``explicit`` maps dotted keys the user actually set (``model.hidden_size``, or bare
    ``hidden_size``) to values. Keys that are not architecture fields (``model.attention_backend``,
    ``model.init_method_std``) are ignored, and so are 0 / None, which our schema reads as "derive
    it". ``rotary_base`` 1000000 equals 1e6. Every contradiction is listed in one error.
    """
    problems = []
    for key, value in explicit.items():
        name = key.split(".", 1)[1] if key.startswith("model.") else key
        if name not in hf_fields or value is None or (value == 0 and not isinstance(value, bool)):
            continue
        if not _same(value, hf_fields[name]):
            problems.append(f"{key}={value!r} but {source} gives {name}={hf_fields[name]!r}")
    if problems:
        raise HFConfigError(
            "model settings contradict the Hugging Face checkpoint (drop them, or use a matching checkpoint): "
            + "; ".join(problems)
        )
