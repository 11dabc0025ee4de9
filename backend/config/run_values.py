"""Run-time values: filling in the values a config leaves to the run, so the saved ``config.yaml`` and
``--print-config`` say what the run really uses (no ``vocab_size: 0`` or ``precision: auto``).

Pure: the tokenizer's vocabulary and the device type come in as numbers and names.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path


def ffn_size(model_cfg) -> int:
    """model.ffn_hidden_size, or 8/3 x hidden rounded up to a multiple of 64 (SwiGLU's usual size)."""
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


def resolve_run_config(cfg, *, tokenizer_vocab: int, device_type: str):
    """A copy of ``cfg`` with every 'decide at run time' value decided (0 / auto / empty)."""
    m, t, c = cfg.model, cfg.train, cfg.checkpoint
    model = dataclasses.replace(
        m,
        ffn_hidden_size=ffn_size(m),
        vocab_size=padded_vocab(m, tokenizer_vocab),
        max_position_embeddings=m.max_position_embeddings or cfg.data.max_seq_length,
        head_dim=m.head_dim or m.hidden_size // m.num_attention_heads,
    )
    precision = t.precision if t.precision != "auto" else ("bf16" if device_type == "cuda" else "fp32")
    train = dataclasses.replace(
        t,
        precision=precision,
        forward_max_tokens_per_gpu=t.forward_max_tokens_per_gpu or t.max_tokens_per_gpu,
    )
    checkpoint = dataclasses.replace(c, dir=c.dir or str(Path(cfg.logger.run_dir) / "checkpoints"))
    return dataclasses.replace(cfg, model=model, train=train, checkpoint=checkpoint)
