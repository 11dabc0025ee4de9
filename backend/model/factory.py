"""The one place a model is built: config -> megatron-core GPTModel -> FSDP2-wrapped, placed model.

The trainer, every tool (log-probabilities, benchmarks, comparisons) and the tests call
``build_model``; a new model source (a Hugging Face checkpoint, mixture-of-experts layers) is
added here once instead of in each caller.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from backend.distributed.fsdp import wrap_fsdp

from .attention import resolve_backend
from .builder import build_gpt, padded_vocab

log = logging.getLogger(__name__)


def use_bf16(precision: str, device: torch.device) -> bool:
    """train.precision: bf16, fp32, or auto (BF16 compute on CUDA, FP32 on CPU)."""
    return precision == "bf16" or (precision == "auto" and device.type == "cuda")


@dataclass
class BuiltModel:
    model: torch.nn.Module  # FSDP2-wrapped, on env.device
    attention_backend: str  # the resolved backend (never "auto")
    num_parameters: int  # before sharding
    vocab_size: int  # the embedding's rows (the tokenizer's vocabulary, padded)
    bf16: bool


def build_model(cfg, env, *, tokenizer_vocab: int, training: bool = True) -> BuiltModel:
    """Build, shard and place the model ``cfg`` describes. Same ``train.seed`` -> same weights.

    ``training=False`` (forward-only tools) admits backends without a backward (flex on CPU).
    """
    backend = resolve_backend(cfg.model.attention_backend, device=env.device, training=training)
    vocab = padded_vocab(cfg.model, tokenizer_vocab)
    model = build_gpt(
        cfg.model, vocab_size=vocab, max_seq_length=cfg.data.max_seq_length, backend=backend, seed=cfg.train.seed
    )
    num_parameters = sum(p.numel() for p in model.parameters())
    bf16 = use_bf16(cfg.train.precision, env.device)
    return BuiltModel(wrap_fsdp(model, env, bf16=bf16), backend, num_parameters, vocab, bf16)
