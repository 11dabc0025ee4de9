"""One validation pass over the resolved config; every problem names its dotted key."""

from __future__ import annotations

import math

from backend.batching import smallest_budget

from .load import ConfigError
from .schema import (
    ATTENTION_BACKENDS,
    BATCH_LAYOUTS,
    DP_WRAPPERS,
    OVERLONG_POLICIES,
    PRECISIONS,
    WANDB_MODES,
    Config,
)

_CHOICES = {
    "model.attention_backend": ATTENTION_BACKENDS,
    "data.overlong": OVERLONG_POLICIES,
    "train.dynamic_batch_layout": BATCH_LAYOUTS,
    "train.precision": PRECISIONS,
    "logger.wandb.mode": WANDB_MODES,
    "parallel.data_parallel_wrapper": DP_WRAPPERS,
    "parallel.backend": ("auto", "gloo", "nccl"),
}
_POSITIVE = (
    "model.num_layers",
    "model.hidden_size",
    "model.num_attention_heads",
    "model.num_query_groups",
    "model.rotary_base",
    "parallel.context_parallel_size",
    "data.max_seq_length",
    "train.global_batch_size",
    "train.micro_batch_size",
    "train.dynamic_batch_pad_to_multiple",
    "train.train_iters",
    "logger.log_interval",
)
_NON_NEGATIVE = (
    "model.ffn_hidden_size",
    "model.vocab_size",
    "model.max_position_embeddings",
    "train.max_tokens_per_gpu",
    "train.dynamic_batch_overhead",
    "train.dynamic_batch_attention_weight",
    "train.dynamic_batch_max_shapes",
    "train.forward_max_tokens_per_gpu",
    "scheduler.warmup_iters",
    "checkpoint.interval",
    "checkpoint.keep_last",
    "optimizer.weight_decay",
    "optimizer.clip_grad",
)


def get(cfg: Config, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def validate(cfg: Config, world_size: int = 1) -> Config:
    """Check the whole config for a world of ``world_size`` processes; raise one ConfigError."""
    errors: list[str] = []
    for key, allowed in _CHOICES.items():
        if get(cfg, key) not in allowed:
            errors.append(f"{key}={get(cfg, key)!r}: allowed values are {', '.join(allowed)}")
    for key in _POSITIVE:
        if get(cfg, key) < 1:
            errors.append(f"{key}={get(cfg, key)}: must be >= 1")
    for key in _NON_NEGATIVE:
        if get(cfg, key) < 0:
            errors.append(f"{key}={get(cfg, key)}: must be >= 0")
    m, t, o = cfg.model, cfg.train, cfg.optimizer
    if m.num_attention_heads >= 1 and m.hidden_size % m.num_attention_heads:
        errors.append(
            f"model.hidden_size={m.hidden_size}: must be divisible by model.num_attention_heads={m.num_attention_heads}"
        )
    if m.num_query_groups >= 1 and m.num_attention_heads % m.num_query_groups:
        errors.append(
            f"model.num_query_groups={m.num_query_groups}: must divide model.num_attention_heads={m.num_attention_heads}"
        )
    if not math.isfinite(t.dynamic_batch_attention_weight):
        errors.append(
            f"train.dynamic_batch_attention_weight={t.dynamic_batch_attention_weight}: must be a finite number"
        )
    if o.lr <= 0:
        errors.append(f"optimizer.lr={o.lr}: must be > 0")
    if not 0 <= o.min_lr <= o.lr:
        errors.append(f"optimizer.min_lr={o.min_lr}: must be in [0, optimizer.lr={o.lr}]")
    for key in ("optimizer.adam_beta1", "optimizer.adam_beta2"):
        if not 0 <= get(cfg, key) < 1:
            errors.append(f"{key}={get(cfg, key)}: must be in [0, 1)")
    if errors:  # the cross-section checks below assume sane single values
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))

    cp = cfg.parallel.context_parallel_size
    if world_size % cp:
        errors.append(f"parallel.context_parallel_size={cp}: must divide the world size {world_size}")
    dp = max(1, world_size // cp)
    if not t.dynamic_batch_enable and t.global_batch_size % (t.micro_batch_size * dp):
        errors.append(
            f"train.global_batch_size={t.global_batch_size}: must be divisible by train.micro_batch_size"
            f" * data-parallel size = {t.micro_batch_size} * {dp} (or set train.dynamic_batch_enable=true)"
        )
    smallest = smallest_budget(t.dynamic_batch_pad_to_multiple, cp)
    for key in ("train.max_tokens_per_gpu", "train.forward_max_tokens_per_gpu"):
        value = get(cfg, key)
        if key == "train.max_tokens_per_gpu" and t.dynamic_batch_enable and value == 0:
            errors.append("train.max_tokens_per_gpu: must be set (>= 1) when train.dynamic_batch_enable is true")
        elif value and value < smallest:
            errors.append(
                f"{key}={value}: must hold at least one CP-aligned row: {smallest} tokens per GPU "
                f"(a row padded to lcm(train.dynamic_batch_pad_to_multiple, 2*cp) over cp={cp})"
            )
    if m.max_position_embeddings and m.max_position_embeddings < cfg.data.max_seq_length:
        errors.append(
            f"model.max_position_embeddings={m.max_position_embeddings}: must be >= data.max_seq_length="
            f"{cfg.data.max_seq_length} (or 0 to follow it)"
        )
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))
    return cfg
