"""One validation pass over the resolved config; every problem names its dotted key."""

from __future__ import annotations

import math

from backend.batching import smallest_budget
from backend.distributed.parallel_dims import ParallelDims

from .errors import ConfigError
from .run_values import ffn_size
from .schema import (
    ATTENTION_BACKENDS,
    BATCH_LAYOUTS,
    DECAY_STYLES,
    DP_WRAPPERS,
    FUSED_LOGITS_KERNELS,
    KL_ESTIMATORS,
    LORA_SYNCS,
    LORA_TARGETS,
    LOSS_NORMALIZATIONS,
    LOSS_TYPES,
    MEMORY_METERS,
    MODEL_HEADS,
    NONFINITE_POLICIES,
    OLD_LOGPROB_SOURCES,
    OVERLONG_POLICIES,
    PIPELINE_ORDERS,
    PRECISIONS,
    RECOMPUTE_GRANULARITIES,
    RL_ADVANTAGES,
    RL_GENERATORS,
    ROLLOUT_CORRECTIONS,
    ROPE_TYPES,
    SCHEDULE_TYPES,
    WANDB_MODES,
    Config,
    wsd_decay_iters,
)

_CHOICES = {
    "model.attention_backend": ATTENTION_BACKENDS,
    "model.recompute_granularity": RECOMPUTE_GRANULARITIES,
    "model.logits_fused_kernel": FUSED_LOGITS_KERNELS,
    "train.nonfinite": NONFINITE_POLICIES,
    "train.memory_meter": MEMORY_METERS,
    "data.overlong": OVERLONG_POLICIES,
    "train.dynamic_batch_layout": BATCH_LAYOUTS,
    "train.precision": PRECISIONS,
    "logger.wandb.mode": WANDB_MODES,
    "parallel.data_parallel_wrapper": DP_WRAPPERS,
    "parallel.pipeline_order": PIPELINE_ORDERS,
    "parallel.backend": ("auto", "gloo", "nccl"),
    "scheduler.type": SCHEDULE_TYPES,
    "scheduler.decay_style": DECAY_STYLES,
    "model.rope_scaling.rope_type": ROPE_TYPES,
    "loss.type": LOSS_TYPES,
    "model.head": MODEL_HEADS,
    "loss.kl_estimator": KL_ESTIMATORS,
    "loss.normalization": LOSS_NORMALIZATIONS,
    "loss.old_logprobs": OLD_LOGPROB_SOURCES,
    "loss.rollout_correction": ROLLOUT_CORRECTIONS,
    "rl.advantage": RL_ADVANTAGES,
    "rl.generator": RL_GENERATORS,
}
# Keys each scaled RoPE type reads without a default (as transformers indexes them).
_ROPE_REQUIRED = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("original_max_position_embeddings",),
}
_POSITIVE = (
    "model.num_layers",
    "model.hidden_size",
    "model.num_attention_heads",
    "model.num_query_groups",
    "model.rotary_base",
    "parallel.context_parallel_size",
    "parallel.expert_parallel_size",
    "parallel.tensor_parallel_size",
    "parallel.pipeline_parallel_size",
    "train.global_batch_size",
    "train.micro_batch_size",
    "train.dynamic_batch_pad_to_multiple",
    "train.train_iters",
    "logger.log_interval",
    "loss.minibatches_per_rollout",
    "rl.prompts_per_step",
    "rl.samples_per_prompt",
    "rl.max_new_tokens",
    "rl.critic_steps_per_step",
)
_NON_NEGATIVE = (
    "data.max_seq_length",  # 0 is resolved to the model's context before validation (resolve.py)
    "model.logits_chunk_tokens",
    "train.nonfinite_max_skips",
    "model.ffn_hidden_size",
    "model.vocab_size",
    "model.max_position_embeddings",
    "model.head_dim",
    "model.sliding_window",
    "model.num_moe_experts",
    "model.moe_ffn_hidden_size",
    "model.moe_aux_loss_coeff",
    "train.dynamic_batch_overhead",
    "train.dynamic_batch_attention_weight",
    "train.dynamic_batch_max_shapes",
    "train.forward_max_tokens_per_gpu",
    "train.eval_interval",
    "train.eval_samples",
    "scheduler.warmup_iters",
    "checkpoint.interval",
    "checkpoint.keep_last",
    "optimizer.weight_decay",
    "optimizer.clip_grad",
    "loss.kl_coef",
    "loss.entropy_coef",
    "loss.value_clip",
    "loss.ratio_clip_low",
    "loss.ratio_clip_high",
    "rl.max_staleness",
)


def get(cfg: Config, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def _auto_budget_errors(t, world_size: int) -> list[str]:
    """train.max_tokens_per_gpu: a whole number >= 0 or "auto"; the memory keys in range."""
    errors = []
    value = t.max_tokens_per_gpu
    if value == "auto":
        if not t.dynamic_batch_enable:
            errors.append("train.max_tokens_per_gpu=auto: needs train.dynamic_batch_enable=true")
    elif isinstance(value, bool) or not isinstance(value, int) or value < 0:
        errors.append(f"train.max_tokens_per_gpu={value!r}: allowed values are a whole number >= 0 or auto")
    if t.memory_limit_gib < 0:
        errors.append(f"train.memory_limit_gib={t.memory_limit_gib}: must be >= 0 (0 = the device's capacity)")
    if not 0 <= t.memory_margin < 1:
        errors.append(f"train.memory_margin={t.memory_margin}: must be in [0, 1)")
    if t.memory_meter == "never" and t.max_tokens_per_gpu == "auto":
        errors.append(
            "train.memory_meter=never with train.max_tokens_per_gpu=auto: the measured budget checks every step's "
            "peak against its prediction; set train.memory_meter to auto or always"
        )
    return errors


def _blend_errors(d) -> list[str]:
    """data.blend: sources with a path and a weight > 0; not beside data.path or data.valid_fraction."""
    if not d.blend:
        return []
    errors = []
    if d.path != "embedded":
        errors.append(
            f"data.blend: set either data.path ({d.path!r}) or data.blend, not both (data.blend's sources are the data)"
        )
    if d.valid_fraction:
        errors.append(
            "data.blend: not with data.valid_fraction (a fraction of which source?); set data.valid_path for validation"
        )
    paths = [src.path for src in d.blend]
    for path in sorted({p for p in paths if paths.count(p) > 1}):
        errors.append(f"data.blend: {path!r} is listed twice (give it one source with the summed weight)")
    for i, src in enumerate(d.blend):
        if not src.path:
            errors.append(f"data.blend[{i}].path: must name a data set")
        if not (math.isfinite(src.weight) and src.weight > 0):
            errors.append(f"data.blend[{i}].weight={src.weight}: must be > 0")
    return errors


#: The trainer's process-group timeout (``init_distributed``'s default).
COLLECTIVE_TIMEOUT_S = 600.0


#: rl.vllm_server.transport's values (``backend.generators.transport.backend`` resolves auto).
TRANSPORTS = ("auto", "gloo", "nccl")


def _vllm_server_errors(rl) -> list[str]:
    v = rl.vllm_server
    errors = []
    if v.num_engines < 1:
        errors.append(f"rl.vllm_server.num_engines={v.num_engines}: must be >= 1")
    if v.tensor_parallel_size < 1:
        errors.append(f"rl.vllm_server.tensor_parallel_size={v.tensor_parallel_size}: must be >= 1")
    if v.bucket_mib < 1:
        errors.append(f"rl.vllm_server.bucket_mib={v.bucket_mib}: must be >= 1")
    if v.transport not in TRANSPORTS:
        errors.append(f"rl.vllm_server.transport={v.transport!r}: must be one of {', '.join(TRANSPORTS)}")
    for key in ("startup_timeout_s", "request_timeout_s", "sync_timeout_s"):
        value = getattr(v, key)
        if not (math.isfinite(value) and value > 0):
            errors.append(f"rl.vllm_server.{key}={value}: must be > 0")
    if v.sync_timeout_s >= COLLECTIVE_TIMEOUT_S:
        errors.append(
            f"rl.vllm_server.sync_timeout_s={v.sync_timeout_s}: must be below the trainer's collective timeout "
            f"({COLLECTIVE_TIMEOUT_S:g} s): the other ranks wait in the weight stream's gathers meanwhile"
        )
    for url in v.urls:
        if not (isinstance(url, str) and url.startswith(("http://", "https://"))):
            errors.append(f"rl.vllm_server.urls: {url!r} is not an http(s) URL (e.g. http://node7:8000)")
    return errors


def _lora_errors(m) -> list[str]:
    """model.lora.*: off at rank 0 (then nothing else is read)."""
    lora = m.lora
    if lora.rank < 0:
        return [f"model.lora.rank={lora.rank}: must be >= 0 (0 = off)"]
    if not lora.rank:
        changed = [f"model.lora.{k}" for k in ("adapter",) if getattr(lora, k)]
        return [f"{', '.join(changed)}: only read with model.lora.rank > 0"] if changed else []
    errors = []
    if not (math.isfinite(lora.alpha) and lora.alpha > 0):
        errors.append(f"model.lora.alpha={lora.alpha}: must be > 0")
    if not 0 <= lora.dropout < 1:
        errors.append(f"model.lora.dropout={lora.dropout}: must be in [0, 1)")
    targets = [lora.target_modules] if isinstance(lora.target_modules, str) else list(lora.target_modules)
    for t in targets:
        if t in ("lm_head", "embed_tokens"):
            errors.append(
                f"model.lora.target_modules: {t}: adapters on the embedding or the output layer (tied to it in most "
                f"models) are not supported; allowed values are {', '.join(LORA_TARGETS)}"
            )
        elif t not in LORA_TARGETS:
            errors.append(f"model.lora.target_modules: {t!r}: allowed values are {', '.join(LORA_TARGETS)}")
    if not targets or len(set(targets)) != len(targets):
        errors.append(f"model.lora.target_modules={targets}: one or more of {', '.join(LORA_TARGETS)}, each once")
    mlp = [t for t in targets if t in ("gate_proj", "up_proj", "down_proj")]
    if m.num_moe_experts and mlp:
        errors.append(
            f"model.lora.target_modules: {', '.join(mlp)}: adapters on MoE experts are not supported (model "
            "has model.num_moe_experts); target the attention projections q_proj, k_proj, v_proj, o_proj"
        )
    return errors


def _rope_errors(m) -> list[str]:
    r = m.rope_scaling
    if r.rope_type not in _ROPE_REQUIRED:
        return []
    errors = [
        f"model.rope_scaling.{key}: must be set for model.rope_scaling.rope_type={r.rope_type}"
        for key in _ROPE_REQUIRED[r.rope_type]
        if getattr(r, key) is None
    ]
    if r.factor is not None and r.factor < 1:
        errors.append(f"model.rope_scaling.factor={r.factor}: must be >= 1 (it extends the context)")
    if r.rope_type == "llama3" and not errors and r.high_freq_factor <= r.low_freq_factor:
        errors.append(
            f"model.rope_scaling.high_freq_factor={r.high_freq_factor}: must exceed "
            f"model.rope_scaling.low_freq_factor={r.low_freq_factor}"
        )
    if r.rope_type == "yarn" and r.factor is None and not m.max_position_embeddings:
        errors.append(
            "model.rope_scaling.factor: yarn without a factor derives it from model.max_position_embeddings, "
            "which is 0: set one of them"
        )
    return errors


def _moe_attention_errors(m) -> list[str]:
    """GPT-OSS keys: experts and top-k, the per-layer window list, kernels that carry sinks/windows."""
    errors = []
    if m.num_moe_experts:
        if not 1 <= m.moe_router_topk <= m.num_moe_experts:
            errors.append(
                f"model.moe_router_topk={m.moe_router_topk}: must be in [1, model.num_moe_experts={m.num_moe_experts}]"
            )
        if m.swiglu_limit is not None and m.swiglu_limit <= 0:
            errors.append(f"model.swiglu_limit={m.swiglu_limit}: must be > 0 (or null for no clamp)")
        if m.recompute_granularity == "full":
            errors.append(
                "model.recompute_granularity=full: not with model.num_moe_experts > 0 (a router recomputed in "
                "backward runs without the microbatch's routing context, so padding would be routed and the "
                "recomputation would not match the forward); use selective"
            )
    else:
        if m.moe_aux_loss_coeff:
            errors.append("model.moe_aux_loss_coeff: needs model.num_moe_experts > 0")
        if m.attention_bias:
            errors.append(
                "model.attention_bias: needs model.num_moe_experts > 0 (megatron-core biases o_proj only with the MLP)"
            )
    flags = list(m.window_attn_skip_freq)
    if flags and len(flags) != m.num_layers:
        errors.append(f"model.window_attn_skip_freq: {len(flags)} entries, one per layer needed ({m.num_layers})")
    if flags and set(flags) - {0, 1}:
        errors.append("model.window_attn_skip_freq: entries must be 1 (sliding) or 0 (full)")
    if flags and not m.sliding_window:
        errors.append("model.window_attn_skip_freq: set model.sliding_window (the window's size) too")
    return errors


def _loss_errors(cfg: Config, from_memory: bool = False) -> list[str]:
    """loss.*: clip ranges, the dual clip, and what the policy loss needs from data and checkpoints
    (``from_memory``: rows are handed over by an RL loop, so data.path is not read)."""
    loss, errors = cfg.loss, []
    for key in (
        "loss.ratio_clip_low",
        "loss.ratio_clip_high",
        "loss.dual_clip",
        "loss.logratio_clamp",
        "loss.temperature",
        "loss.rollout_correction_cap",
        "loss.rollout_correction_floor",
        "loss.kl_clamp",
    ):
        if not math.isfinite(get(cfg, key)):
            errors.append(f"{key}={get(cfg, key)}: must be a finite number")
    if errors:
        return errors
    if loss.ratio_clip_low >= 1:
        errors.append(f"loss.ratio_clip_low={loss.ratio_clip_low}: must be in [0, 1) (the ratio's floor is 1 - it)")
    if loss.dual_clip != 0 and loss.dual_clip <= 1:
        errors.append(f"loss.dual_clip={loss.dual_clip}: must be 0 (off) or > 1")
    if loss.logratio_clamp <= 0:
        errors.append(f"loss.logratio_clamp={loss.logratio_clamp}: must be > 0")
    if loss.temperature <= 0:
        errors.append(f"loss.temperature={loss.temperature}: must be > 0 (the sampler's temperature)")
    if loss.kl_clamp < 0:
        errors.append(f"loss.kl_clamp={loss.kl_clamp}: must be >= 0 (0 = off; verl's low_var_kl clamps at 10)")
    if loss.rollout_correction_cap <= 0 or not 0 <= loss.rollout_correction_floor < loss.rollout_correction_cap:
        errors.append(
            f"loss.rollout_correction_floor={loss.rollout_correction_floor}, loss.rollout_correction_cap="
            f"{loss.rollout_correction_cap}: need 0 <= floor < cap"
        )
    if loss.rollout_correction != "none" and loss.old_logprobs == "rollout":
        errors.append(
            f"loss.rollout_correction={loss.rollout_correction}: corrects old log-probabilities against the "
            f"sampler's, which loss.old_logprobs=rollout makes the same (every weight 1); use recompute or data"
        )
    if (loss.type == "value") != (cfg.model.head == "value"):
        errors.append(
            f"loss.type={loss.type} with model.head={cfg.model.head}: a critic is model.head=value trained with "
            f"loss.type=value; a language model keeps model.head=lm"
        )
    if cfg.model.head == "value" and (cfg.model.num_moe_experts or cfg.model.attention_sinks):
        errors.append("model.head=value: a critic is built on the dense families (Qwen3, Llama, Qwen2), not GPT-OSS")
    if cfg.model.head == "value" and cfg.model.logits_fused_kernel != "none":
        errors.append("model.logits_fused_kernel: a critic's head has one output, no vocabulary (set none)")
    if cfg.model.head == "value" and cfg.model.logits_chunk_tokens:
        errors.append("model.logits_chunk_tokens: a critic's head has one output, no vocabulary to chunk (set 0)")
    if loss.type != "value" and loss.value_clip != type(loss)().value_clip:
        errors.append(f"loss.value_clip: only read with loss.type=value (loss.type={loss.type})")
    if loss.type in ("cross_entropy", "value"):
        changed = [
            f"loss.{name}"
            for name in (
                "kl_coef",
                "entropy_coef",
                "reference_checkpoint",
                "temperature",
                "rollout_correction",
                "kl_clamp",
            )
            if getattr(loss, name) != getattr(type(loss)(), name)
        ]
        if loss.minibatches_per_rollout != 1:
            changed.append("loss.minibatches_per_rollout")
        if changed:
            errors.append(f"{', '.join(changed)}: only read with loss.type=policy (loss.type={loss.type})")
        return errors
    if loss.reference_checkpoint and not loss.kl_coef:
        errors.append(
            f"loss.reference_checkpoint={loss.reference_checkpoint!r}: only used for the KL penalty; set "
            f"loss.kl_coef > 0 (or leave it empty: a second model costs memory and a forward pass per microbatch)"
        )
    if loss.minibatches_per_rollout > 1 and loss.old_logprobs != "recompute":
        errors.append(
            f"loss.minibatches_per_rollout={loss.minibatches_per_rollout}: only read with loss.old_logprobs=recompute "
            f"(with data the rows carry them; with detach every step is on-policy)"
        )
    if loss.old_logprobs == "recompute" and cfg.checkpoint.interval % loss.minibatches_per_rollout:
        errors.append(
            f"checkpoint.interval={cfg.checkpoint.interval}: must be a multiple of loss.minibatches_per_rollout="
            f"{loss.minibatches_per_rollout} (a checkpoint inside a rollout batch could not recompute its old "
            f"log-probabilities on resume)"
        )
    if from_memory:  # rows come from the caller, as given (nothing is appended to them)
        return errors
    if cfg.data.path == "embedded":
        errors.append(
            "data.path=embedded: loss.type=policy trains on rollouts whose rows carry advantages (and old/ref "
            "log-probabilities); point data.path at such a JSONL file or .bin/.idx prefix (docs/guides/policy-loss.md)"
        )
    if cfg.data.append_eod:
        errors.append(
            "data.append_eod: with loss.type=policy rows carry per-token log-probabilities and advantages, and an "
            "appended end-of-document id has none; end the rows with it yourself (set data.append_eod=false)"
        )
    return errors


def validate(cfg: Config, world_size: int = 1, *, from_memory: bool = False) -> Config:
    """Check the whole config for a world of ``world_size`` processes; raise one ConfigError.
    ``from_memory``: the config of an RL worker, whose rows come from its caller (not data.path)."""
    errors: list[str] = []
    for key, allowed in _CHOICES.items():
        if get(cfg, key) not in allowed:
            value = get(cfg, key)
            hint = " (YAML reads on, off, yes and no as booleans)" if str(value) in ("True", "False") else ""
            errors.append(f"{key}={value!r}: allowed values are {', '.join(allowed)}{hint}")
    for key in _POSITIVE:
        if get(cfg, key) < 1:
            errors.append(f"{key}={get(cfg, key)}: must be >= 1")
    for key in _NON_NEGATIVE:
        if get(cfg, key) < 0:
            errors.append(f"{key}={get(cfg, key)}: must be >= 0")
    m, t, o = cfg.model, cfg.train, cfg.optimizer
    if cfg.data.max_seq_length == 0:  # a config that did not come through load_config's resolution
        errors.append("data.max_seq_length=0: the model's context was not resolved; set data.max_seq_length >= 1")
    if not m.head_dim and m.num_attention_heads >= 1 and m.hidden_size % m.num_attention_heads:
        errors.append(
            f"model.hidden_size={m.hidden_size}: must be divisible by model.num_attention_heads={m.num_attention_heads}"
            " (or set model.head_dim)"
        )
    head_dim = m.head_dim or (m.hidden_size // max(1, m.num_attention_heads))
    if head_dim % 2:
        errors.append(f"model.head_dim={head_dim}: RoPE needs an even head size")
    errors += _rope_errors(m)
    errors += _lora_errors(m)
    errors += _moe_attention_errors(m)
    errors += _loss_errors(cfg, from_memory)
    cp = cfg.parallel.context_parallel_size
    packed = t.dynamic_batch_enable and t.dynamic_batch_layout == "packed"
    if m.attention_backend == "te" and packed and cp > 1 and (m.attention_sinks or m.sliding_window):
        groups = m.num_query_groups or m.num_attention_heads
        tp = max(1, cfg.parallel.tensor_parallel_size)  # TE sees each TP rank's heads
        if (m.num_attention_heads // tp) % cp or (groups // tp) % cp:
            errors.append(
                f"parallel.context_parallel_size={cp}: with model.attention_backend=te, sinks/windows and packed rows, "
                f"Transformer Engine exchanges heads (a2a), so model.num_attention_heads={m.num_attention_heads} and "
                f"model.num_query_groups={groups} over parallel.tensor_parallel_size={tp} must divide by it (or use "
                "flex, or the padded layout)"
            )
    if m.num_query_groups >= 1 and m.num_attention_heads % m.num_query_groups:
        errors.append(
            f"model.num_query_groups={m.num_query_groups}: must divide model.num_attention_heads={m.num_attention_heads}"
        )
    if not (math.isfinite(cfg.rl.temperature) and cfg.rl.temperature > 0):
        errors.append(f"rl.temperature={cfg.rl.temperature}: must be > 0")
    if not (math.isfinite(cfg.rl.reward_timeout_s) and cfg.rl.reward_timeout_s >= 0):
        errors.append(f"rl.reward_timeout_s={cfg.rl.reward_timeout_s}: must be >= 0 (0 = no limit)")
    for key in ("rl.gamma", "rl.lam"):
        if not 0 <= get(cfg, key) <= 1:
            errors.append(f"{key}={get(cfg, key)}: must be in [0, 1]")
    if cfg.rl.max_staleness > 0 and cfg.rl.generator == "vllm":
        errors.append(
            f"rl.max_staleness={cfg.rl.max_staleness}: the asynchronous loop runs rl.generator=hf in a process of its "
            "own or rl.generator=vllm_server; rl.generator=vllm is colocated only (set one of those, or "
            "rl.max_staleness=0)"
        )
    errors += _vllm_server_errors(cfg.rl)
    if cfg.rl.lora_sync not in LORA_SYNCS:
        errors.append(f"rl.lora_sync={cfg.rl.lora_sync!r}: allowed values are {', '.join(LORA_SYNCS)}")
    elif cfg.rl.lora_sync == "adapter" and cfg.model.lora.rank > 512:
        errors.append(f"rl.lora_sync=adapter: vLLM serves LoRA ranks up to 512 (model.lora.rank={cfg.model.lora.rank})")
    elif cfg.rl.lora_sync == "adapter" and not (cfg.model.lora.rank and cfg.rl.generator == "vllm"):
        errors.append(
            f"rl.lora_sync=adapter: sends LoRA adapters to the in-process vLLM engine, so it needs model.lora.rank > 0 "
            f"and rl.generator=vllm (model.lora.rank={cfg.model.lora.rank}, rl.generator={cfg.rl.generator}); the "
            "other generators take merged weights (rl.lora_sync=merged)"
        )
    if any(not isinstance(t, int) or t < 0 for t in cfg.rl.stop_token_ids):
        errors.append(f"rl.stop_token_ids={cfg.rl.stop_token_ids}: must be token ids (whole numbers >= 0)")
    errors += _blend_errors(cfg.data)
    if not 0 <= cfg.data.valid_fraction < 1:
        errors.append(f"data.valid_fraction={cfg.data.valid_fraction}: must be in [0, 1)")
    if not 0 < m.norm_epsilon < 1:
        errors.append(f"model.norm_epsilon={m.norm_epsilon}: must be in (0, 1) (1e-6 Qwen, 1e-5 Llama)")
    if not math.isfinite(t.dynamic_batch_attention_weight):
        errors.append(
            f"train.dynamic_batch_attention_weight={t.dynamic_batch_attention_weight}: must be a finite number"
        )
    if not (math.isfinite(o.lr) and o.lr >= 0):  # 0 freezes the weights: a control run (RL: the reward stays flat)
        errors.append(f"optimizer.lr={o.lr}: must be >= 0")
    if not 0 <= o.min_lr <= o.lr:
        errors.append(f"optimizer.min_lr={o.min_lr}: must be in [0, optimizer.lr={o.lr}]")
    for key in ("optimizer.adam_beta1", "optimizer.adam_beta2"):
        if not 0 <= get(cfg, key) < 1:
            errors.append(f"{key}={get(cfg, key)}: must be in [0, 1)")
    sc = cfg.scheduler
    if not 0 < sc.decay_fraction <= 1:
        errors.append(f"scheduler.decay_fraction={sc.decay_fraction}: must be in (0, 1]")
    if errors:  # the cross-section checks below assume sane single values
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))

    dims = ParallelDims.from_config(cfg.parallel, world_size)
    errors += dims.errors(num_moe_experts=m.num_moe_experts, model=m)  # the one place the sizes are checked
    if dims.tp > 1 and ffn_size(m) % dims.tp:
        errors.append(f"parallel.tensor_parallel_size={dims.tp}: must divide the FFN size {ffn_size(m)}")
    cp, dp = dims.cp, dims.dp
    if not t.dynamic_batch_enable and t.global_batch_size % (t.micro_batch_size * dp):
        errors.append(
            f"train.global_batch_size={t.global_batch_size}: must be divisible by train.micro_batch_size"
            f" * data-parallel size = {t.micro_batch_size} * {dp} (or set train.dynamic_batch_enable=true)"
        )
    smallest = smallest_budget(t.dynamic_batch_pad_to_multiple, cp, dims.sp)
    errors += _auto_budget_errors(t, world_size)
    for key in ("train.max_tokens_per_gpu", "train.forward_max_tokens_per_gpu"):
        value = get(cfg, key)
        if value == "auto" or not isinstance(value, int):  # auto, or refused by _auto_budget_errors
            continue
        if key == "train.max_tokens_per_gpu" and t.dynamic_batch_enable and value == 0:
            errors.append("train.max_tokens_per_gpu: must be set (>= 1) when train.dynamic_batch_enable is true")
        elif value and value < smallest:
            errors.append(
                f"{key}={value}: must hold at least one aligned row: {smallest} tokens per GPU "
                f"(a row padded to lcm(train.dynamic_batch_pad_to_multiple, 2*cp*sp) over cp={cp} x sp={dims.sp})"
            )
    if cfg.checkpoint.keep_best and not t.eval_interval:
        errors.append(
            "checkpoint.keep_best: the best step is the one with the lowest valid_loss; set train.eval_interval"
        )
    if t.eval_interval and not (cfg.data.valid_path or cfg.data.valid_fraction):
        errors.append("train.eval_interval: set data.valid_path or data.valid_fraction to say what to evaluate")
    if t.eval_interval and not (t.forward_max_tokens_per_gpu or t.max_tokens_per_gpu):
        errors.append(
            "train.eval_interval: evaluation is planned under a token budget; set train.forward_max_tokens_per_gpu"
        )
    if sc.type == "wsd":
        decay = wsd_decay_iters(sc.decay_fraction, t.train_iters)
        if sc.warmup_iters + decay > t.train_iters:
            errors.append(
                f"scheduler.warmup_iters={sc.warmup_iters}: warm-up plus the wsd decay phase (ceil("
                f"scheduler.decay_fraction={sc.decay_fraction} * train.train_iters={t.train_iters}) = {decay} steps) "
                f"must fit in train.train_iters={t.train_iters}"
            )
    if m.max_position_embeddings and m.max_position_embeddings < cfg.data.max_seq_length:
        errors.append(
            f"model.max_position_embeddings={m.max_position_embeddings}: must be >= data.max_seq_length="
            f"{cfg.data.max_seq_length} (or 0 to follow it)"
        )
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))
    return cfg
