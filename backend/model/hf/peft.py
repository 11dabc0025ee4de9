"""PEFT's LoRA adapter format: ``adapter_config.json`` and ``adapter_model.safetensors``.

Our adapters are PEFT's one to one (``backend.model.lora``: one (A, B) pair per Hugging Face
projection), so only names move: ``decoder.layers.3.self_attention.linear_qkv.lora.adapters.q_proj.lora_A``
is PEFT's ``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`` ([r, in]; B is
[out, r]), the key ``PeftModel.save_pretrained`` writes (adapter name dropped). The config holds
what PEFT reads to rebuild them (``r``, ``lora_alpha``, ``target_modules``, ...); an adapter we
cannot represent exactly (rsLoRA's sqrt(r) scaling, per-module rank or alpha patterns, biases,
extra trained modules, DoRA) is refused by name on import, never approximated.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from backend.errors import CheckpointError

from ..lora import ADAPTER, FUSED, HF_PARENT

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
_PEFT = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
#: HF projection -> the megatron-core layer that holds its adapter.
LAYER_OF = {p: layer for layer, projections in FUSED.items() for p in projections}


def peft_key(name: str) -> str:
    """PEFT's key for one of our adapter parameters (its whole-model name)."""
    m = ADAPTER.fullmatch(name)
    if m is None:
        raise KeyError(f"{name}: not a LoRA adapter parameter")
    layer, proj, which = m.group(2), m.group(4), m.group(5)
    return f"base_model.model.model.layers.{layer}.{HF_PARENT[proj]}.{proj}.lora_{which}.weight"


def our_name(key: str) -> str | None:
    m = _PEFT.fullmatch(key)
    if m is None or m.group(3) not in LAYER_OF or HF_PARENT[m.group(3)] != m.group(2):
        return None
    layer, proj, which = m.group(1), m.group(3), m.group(4)
    return f"decoder.layers.{layer}.{LAYER_OF[proj]}.lora.adapters.{proj}.lora_{which}"


def adapter_config(lora_cfg, base: str) -> dict:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": int(lora_cfg.rank),
        "lora_alpha": float(lora_cfg.alpha),
        "lora_dropout": float(lora_cfg.dropout),
        "target_modules": sorted(lora_cfg.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "inference_mode": True,
    }


def write_adapter(out_dir, named, lora_cfg, *, base: str, dtype: torch.dtype = torch.float32) -> Path:
    """``named``: (our whole-model name, full tensor) of every adapter parameter."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {peft_key(n): t.detach().to("cpu", dtype).contiguous() for n, t in named}
    if not tensors:
        raise ValueError("no LoRA adapter parameters to write (model.lora.rank is 0?)")
    save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})
    (out / CONFIG).write_text(json.dumps(adapter_config(lora_cfg, base), indent=2) + "\n", encoding="utf-8")
    return out


def read_adapter(path, lora_cfg) -> dict[str, torch.Tensor]:
    """A PEFT LoRA adapter directory as {our whole-model name: tensor}, checked against
    ``model.lora`` (rank, alpha, targets): a mismatch names the key and both values."""
    root = Path(path)
    for name in (CONFIG, WEIGHTS):
        if not (root / name).is_file():
            raise CheckpointError(f"model.lora.adapter={path}: no {name} (a PEFT LoRA adapter directory holds both)")
    try:
        config = json.loads((root / CONFIG).read_text(encoding="utf-8"))
    except ValueError as e:
        raise CheckpointError(f"{root / CONFIG}: not JSON ({e})") from None
    where = root / CONFIG
    if config.get("peft_type") != "LORA":
        raise CheckpointError(f"{where}: peft_type={config.get('peft_type')!r}, only LORA adapters import")
    for key, ours in (("r", lora_cfg.rank), ("lora_alpha", lora_cfg.alpha)):
        if float(config.get(key, -1)) != float(ours):
            raise CheckpointError(f"{where}: {key}={config.get(key)!r}, but model.lora sets {ours} (set it to match)")
    targets = config.get("target_modules")
    targets = [targets] if isinstance(targets, str) else list(targets or [])
    if sorted(targets) != sorted(lora_cfg.target_modules):
        raise CheckpointError(
            f"{where}: target_modules={sorted(targets)}, but model.lora.target_modules={sorted(lora_cfg.target_modules)}"
        )
    for key, plain in (("use_rslora", False), ("use_dora", False), ("bias", "none"), ("fan_in_fan_out", False)):
        if config.get(key, plain) != plain:
            raise CheckpointError(f"{where}: {key}={config[key]!r} is not supported (only {plain!r} imports exactly)")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform"):
        if config.get(key):
            raise CheckpointError(f"{where}: {key}={config[key]!r} is not supported (one rank and alpha for all)")
    tensors = load_file(str(root / WEIGHTS))
    out = {}
    for key, tensor in tensors.items():
        name = our_name(key)
        if name is None:
            raise CheckpointError(f"{root / WEIGHTS}: {key} is not a LoRA A or B of a decoder layer's projection")
        out[name] = tensor
    return out
