"""The frozen base a LoRA checkpoint's adapters belong to, named by its source and digest.

A LoRA checkpoint holds the adapters and their optimizer state only (``store.state_options``),
so it is worth something only on the base it was trained on. ``meta.json`` records that base
(``lora_base``): a Hugging Face directory by its path and the xxh3_128 digest of its config.json
and safetensors files (``integrity.file_digest``: about 0.05 s a GiB, on rank 0, once a run), a
randomly initialised base by ``train.seed`` and its architecture. Resuming, or exporting, on a
base with another digest is an error naming both, never adapters silently run on other weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import xxhash

from backend.errors import CheckpointError

from .integrity import file_digest


def base_identity(cfg) -> dict | None:
    """{"source", "digest"} of the run's base model (None without LoRA). Reads every weight
    file of ``model.hf_checkpoint``: call it on one rank and share the result."""
    if not cfg.model.lora.rank:
        return None
    h = xxhash.xxh3_128()
    hf = cfg.model.hf_checkpoint
    if hf:
        root = Path(hf)
        files = sorted(p for p in root.iterdir() if p.name == "config.json" or p.suffix == ".safetensors")
        for p in files:
            h.update(f"{p.name}:{file_digest(p)}\n".encode())
        return {"source": str(root.resolve()), "digest": h.hexdigest()}
    # the architecture only: keys a resume may change (the attention kernel, recomputation, the
    # output layer's chunking) are not the base
    model = {k: v for k, v in vars(cfg.model).items() if k not in RUNTIME_KEYS}
    h.update(json.dumps({"seed": cfg.train.seed, "model": model}, sort_keys=True, default=str).encode())
    return {"source": f"initialised from train.seed={cfg.train.seed}", "digest": h.hexdigest()}


#: model.* keys that say how the base runs, not what it is (``resume_policy``'s allowed ones), and the adapters'.
RUNTIME_KEYS = ("lora", "attention_backend", "recompute_granularity", "logits_chunk_tokens", "logits_fused_kernel")


def check_lora_checkpoint(cfg, env, step_dir) -> None:
    """Before loading ``step_dir``'s adapters onto this run's base (export, log-probabilities,
    generation, a reference): the base they were trained on must be this one."""
    if not cfg.model.lora.rank:
        return
    from .meta import read_meta

    check_base(read_meta(step_dir), share_base_identity(cfg, env), step_dir)


def check_base(meta: dict, identity: dict | None, path) -> None:
    """A LoRA checkpoint's ``lora_base`` against this run's base: refused when they differ."""
    theirs = meta.get("lora_base")
    if identity is None or theirs is None or theirs.get("digest") == identity["digest"]:
        return
    raise CheckpointError(
        f"{path}: its LoRA adapters were trained on the base {theirs.get('source')} (digest {theirs.get('digest')}), "
        f"but this run's base is {identity['source']} (digest {identity['digest']}): the adapters belong to that "
        "base; set model.hf_checkpoint (or train.seed) to it"
    )


def share_base_identity(cfg, env) -> dict | None:
    """``base_identity`` computed on rank 0 (it reads the base's files once) and given to all."""
    if not cfg.model.lora.rank:
        return None
    from backend.distributed.collectives import all_gather_objects

    mine = base_identity(cfg) if env.is_main else None
    if env.world_size == 1:
        return mine
    return all_gather_objects(mine, group=env.group("world"))[0]
