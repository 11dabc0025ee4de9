"""One of our checkpoints -> a Hugging Face directory that transformers loads with no custom code.

A ``step_*`` directory holds the model (and optimizer) as a torch distributed checkpoint; the
run's resolved ``config.yaml`` says what architecture it is. Export builds that model with
``build_model(..., empty=True)`` in a world of one process (meta device, then empty shards: no
random initialisation), loads only the model weights with the pickle-free ``safe_load``, then
gathers one full parameter at a time and hands it to ``backend.model.hf.export``, which writes
sharded safetensors, config.json and the tokenizer files.

The Hugging Face family: an imported model goes back to its own (``model_type`` of
``model.hf_checkpoint``'s config.json); a model trained from scratch goes to the family whose
flags it has: qwen3 with QK norm, qwen2 with QKV bias, llama with neither (both: refused).
Tokenizer and chat-template files come from ``model.hf_checkpoint``, else from the directory of
``data.tokenizer`` when that is a tokenizer.json path; a byte-tokenizer run exports weights only.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from backend.data.tokenizers import build_tokenizer
from backend.distributed.fsdp import full_tensor
from backend.model.factory import build_model
from backend.model.hf.export import DTYPES, export_hf_dir
from backend.model.hf.peft import write_adapter
from backend.model.hf.safetensors_io import DEFAULT_MAX_SHARD_BYTES
from backend.model.lora import is_adapter, merge_stream
from backend.model.tensor_parallel import full_param

from .lora_base import check_lora_checkpoint
from .pp_state import whole_model_tensors
from .store import load_model_weights

log = logging.getLogger(__name__)


def full_named_tensors(model: torch.nn.Module, keep=None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) per parameter, one at a time (FSDP2 shards gathered as they are asked
    for, then the tensor-parallel slices); under pipeline parallelism every stage's, in the whole
    model's names and order, on every rank (``pp_state.whole_model_tensors``). ``keep(name)``:
    only those (the same on every rank: LoRA's adapters alone, nothing else gathered)."""
    if getattr(model, "stage_names", None) is not None:
        yield from whole_model_tensors(model, lambda name, t: full_param(model, name, full_tensor(t)), keep)
        return
    for name, t in model.state_dict().items():
        if keep is None or keep(name):
            yield name, full_param(model, name, full_tensor(t)) if isinstance(t, torch.Tensor) else t


def export_adapter(model, cfg, out_dir, *, dtype: str = "fp32") -> Path:
    """``model``'s LoRA adapters (whole tensors) as a PEFT adapter directory."""
    if cfg.model.head == "value":
        raise ValueError(
            "a critic's LoRA checkpoint also trained its value head, which a PEFT adapter of a causal LM cannot "
            "hold: export it merged (--merge)"
        )
    base = str(Path(cfg.model.hf_checkpoint).resolve()) if cfg.model.hf_checkpoint else ""
    named = full_named_tensors(model, keep=is_adapter)
    out = write_adapter(out_dir, named, cfg.model.lora, base=base, dtype=DTYPES[dtype])
    log.info("exported the LoRA adapters (PEFT format, %s) to %s", dtype, out)
    return out


def _tokenizer_source(cfg) -> Path | None:
    if cfg.model.hf_checkpoint and Path(cfg.model.hf_checkpoint).is_dir():
        return Path(cfg.model.hf_checkpoint)
    tok = cfg.data.tokenizer
    if tok not in ("byte", "auto") and Path(tok).exists():
        return Path(tok) if Path(tok).is_dir() else Path(tok).parent
    return None


def tokenizer_note(cfg, out) -> str:
    """Why an export holds no tokenizer files, and what to do (data.tokenizer=byte has none)."""
    return (
        f"{out}: no tokenizer files written: data.tokenizer={cfg.data.tokenizer} is not a Hugging Face tokenizer "
        f"(the byte tokenizer's ids are the UTF-8 bytes 0-255{', 256 the end of document' if cfg.data.append_eod else ''}); "
        f"AutoModelForCausalLM loads the weights, and a model trained on a Hugging Face tokenizer (data.tokenizer=DIR "
        f"or model.hf_checkpoint) gets its files copied"
    )


def export_fields(cfg, fields: dict) -> dict:
    """The model fields an export (or an RL weight stream) writes: an imported model keeps its own
    family (``model_type`` of ``model.hf_checkpoint``'s config.json), a model trained from
    scratch takes the family its flags name."""
    fields = dict(fields)
    if cfg.model.hf_checkpoint and (Path(cfg.model.hf_checkpoint) / "config.json").is_file():
        fields["model_type"] = json.loads((Path(cfg.model.hf_checkpoint) / "config.json").read_text())["model_type"]
    if fields["model_type"] is None:
        raise ValueError("model.qk_layernorm and model.qkv_bias are both set: no Hugging Face family has both")
    return fields


def export_checkpoint(
    step_dir: str | Path,
    cfg,
    out_dir: str | Path,
    env,
    *,
    dtype: str = "bf16",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    merge: bool = False,
) -> Path:
    """Write ``step_dir``'s model as a HF directory in ``out_dir``; returns ``out_dir``. A LoRA
    checkpoint: its adapters in PEFT's format, or with ``merge`` the merged whole model."""
    step_dir = Path(step_dir)
    if not (step_dir / ".metadata").is_file():
        raise FileNotFoundError(f"{step_dir}: not a complete checkpoint (no .metadata); pass a step_* directory")
    vocab = cfg.model.vocab_size or build_tokenizer(cfg.data.tokenizer).vocab_size
    built = build_model(cfg, env, tokenizer_vocab=vocab, training=False, empty=True)
    fields = export_fields(cfg, built.fields)
    source = _tokenizer_source(cfg)
    if cfg.model.lora.rank:  # the checkpoint's adapters belong to one base: this run's must be it
        check_lora_checkpoint(cfg, env, step_dir)
    elif merge:
        raise ValueError(f"--merge: {step_dir} is not a LoRA checkpoint (model.lora.rank is 0): nothing to merge")
    load_model_weights(built.model, step_dir)  # model weights only; the optimizer state is not read
    if cfg.model.lora.rank and not merge:
        return export_adapter(built.model, cfg, out_dir, dtype=dtype)
    out = export_hf_dir(
        fields,
        merge_stream(built.model, full_named_tensors(built.model), fields),
        out_dir,
        dtype=dtype,
        source_dir=source,
        max_shard_bytes=max_shard_bytes,
    )
    log.info("exported %s as a %s model (%s) to %s", step_dir, fields["model_type"], dtype, out)
    if source is None:
        log.warning("%s", tokenizer_note(cfg, out))
    return out
