"""The one place a model is built: config -> megatron-core GPTModel -> FSDP2-wrapped, placed model
(one rank in FP32: the plain module, ``backend.distributed.fsdp.uses_fsdp``).

The trainer, every tool (log-probabilities, benchmarks, comparisons, export) and the tests call
``build_model``; a new model source is added here once instead of in each caller.

Two sources of weights:

- none (``model.hf_checkpoint`` empty): built on the CPU and initialised from ``train.seed``,
  then sharded.
- a Hugging Face checkpoint: built on the meta device (no storage), sharded by FSDP2, given
  empty local shards (``to_empty``) and filled from the safetensors one parameter at a time,
  each rank keeping its own slice. No rank ever holds a randomly initialised full model: for
  Qwen3-4B that is 16 GB of FP32 per rank not allocated, and the peak extra host memory while
  loading is one full parameter (the 0.78 GB embedding in FP32).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from backend.config import ConfigError
from backend.config.run_values import padded_vocab
from backend.distributed.fsdp import wrap_fsdp

from .attention import resolve_backend
from .builder import build_gpt
from .expert_parallel import place_experts
from .fields import is_value_head, model_fields
from .forward import OutputSettings, output_settings, set_output_settings
from .hf.load import has_value_head, init_value_head, load_hf_weights
from .hf.mapping import VALUE_HEAD
from .lora import is_adapter
from .lora_source import start_adapters
from .output import install_chunked_output
from .pipeline_stage import StageNames, copy_from_whole, stage_names
from .recompute import apply_recompute
from .tensor_parallel import record_layout, whole_numel

log = logging.getLogger(__name__)


def use_bf16(precision: str, device: torch.device) -> bool:
    """train.precision: bf16, fp32, or auto (BF16 compute on CUDA, FP32 on CPU)."""
    return precision == "bf16" or (precision == "auto" and device.type == "cuda")


@dataclass
class BuiltModel:
    model: torch.nn.Module  # FSDP2-wrapped (one FP32 rank: plain), on env.device
    attention_backend: str  # the resolved backend (never "auto")
    num_parameters: int  # before sharding
    vocab_size: int  # the embedding's rows (the tokenizer's vocabulary, padded; an import's exactly)
    bf16: bool
    fields: dict  # the architecture as backend.config.hf.FIELDS (what HF export writes)


def _meta_model(cfg, vocab: int, backend: str, env=None, stage: StageNames | None = None) -> torch.nn.Module:
    with torch.device("meta"):
        return build_gpt(
            cfg.model,
            vocab_size=vocab,
            max_seq_length=cfg.data.max_seq_length,
            backend=backend,
            seed=0,
            stage=None if stage is None else (stage.first, stage.count),
            **_tp(env),
        )


def _stage_model(cfg, vocab: int, backend: str, env, stage: StageNames) -> torch.nn.Module:
    """One pipeline stage on the CPU (its weights filled by the caller)."""
    return build_gpt(
        cfg.model,
        vocab_size=vocab,
        max_seq_length=cfg.data.max_seq_length,
        backend=backend,
        seed=cfg.train.seed,
        stage=(stage.first, stage.count),
        **_tp(env),
    )


def _tp(env) -> dict:
    """build_gpt's tensor-parallel arguments for this world (none outside one)."""
    if env is None or env.tp_size == 1:
        return {}
    return dict(tp=env.tp_size, sequence_parallel=env.dims.sequence_parallel)


def meta_model(cfg, *, tokenizer_vocab: int) -> torch.nn.Module:
    """The unsharded model on the meta device: names, shapes and parameter counts with no memory
    (Qwen3-4B builds in seconds on a laptop; its FP32 weights would need 16 GB)."""
    return _meta_model(cfg, padded_vocab(cfg.model, tokenizer_vocab), "sdpa")


def _check_no_buffers(model: torch.nn.Module) -> None:
    """``to_empty`` leaves buffers uninitialised, and a HF checkpoint does not hold ours. GPTModel
    with the local spec and our core attention has none (RoPE tables are computed per microbatch
    from the frozen ``Rope``); a module that adds one must be re-created here, not left garbage."""
    buffers = [name for name, _ in model.named_buffers()]
    if buffers:
        raise RuntimeError(f"meta-device build has buffers that loading would leave uninitialised: {buffers[:5]}")


def _configure_output(model, cfg, *, tokenizer_vocab: int, vocab: int) -> None:
    """How the output layer is evaluated: ``model.logits_chunk_tokens`` (chunked, ``output.py``)
    and the vocabulary limit. Rows we added to round the tokenizer's vocabulary up to a multiple of
    128 (257 -> 384 with the byte tokenizer's end of document) are ids no tokenizer produces: they
    stay out of the softmax and the entropy. An imported model keeps every row, as transformers
    does, and so does a vocabulary the user sized (``model.vocab_size`` other than that rounding)."""
    chunk = cfg.model.logits_chunk_tokens
    if is_value_head(cfg.model):  # a critic's head has one output, no vocabulary
        set_output_settings(model, OutputSettings())
        return
    fused = cfg.model.logits_fused_kernel
    if fused == "liger":
        _check_liger()
    if chunk or fused != "none":
        install_chunked_output(model)
    padded = not cfg.model.hf_checkpoint and tokenizer_vocab < vocab == -(-tokenizer_vocab // 128) * 128
    limit = tokenizer_vocab if padded else None
    set_output_settings(model, OutputSettings(logits_chunk_tokens=chunk, vocab_limit=limit, fused_kernel=fused))


def _check_liger() -> None:
    """``model.logits_fused_kernel=liger`` needs CUDA and Liger-Kernel: refused by name otherwise
    (never a silent fall-back to another kernel the user did not ask for)."""
    if not torch.cuda.is_available():
        raise ConfigError(
            "model.logits_fused_kernel=liger: Liger-Kernel's Triton kernels need a CUDA device (set none)"
        )
    try:
        import liger_kernel.transformers.functional  # noqa: F401
    except ImportError as e:
        raise ConfigError(
            f"model.logits_fused_kernel=liger: liger-kernel does not import ({e}); install the liger extra "
            "(pip install -e '.[liger]') or set none"
        ) from None


def build_model(cfg, env, *, tokenizer_vocab: int, training: bool = True, empty: bool = False) -> BuiltModel:
    """Build, shard and place the model ``cfg`` describes, with its weights: from
    ``model.hf_checkpoint`` when set, else from ``train.seed`` (same seed -> same weights).

    ``training=False`` (forward-only tools) admits backends without a backward (flex on CPU).
    ``empty=True`` allocates the shards without initialising them, for a caller that fills every
    parameter itself (from one of our checkpoints: export, log-probabilities of a trained model).
    With LoRA (``model.lora.rank``) our checkpoints hold the adapters only: the base is then
    loaded as without ``empty`` and only the adapters are left to the caller.
    """
    m = cfg.model
    if m.num_moe_experts and cfg.parallel.expert_parallel_size != env.ep_size:  # a dense model has no experts to place
        raise ValueError(
            f"parallel.expert_parallel_size={cfg.parallel.expert_parallel_size}, but this world's groups were built "
            f"for EP {env.ep_size} (init_distributed(..., ep_size=) / init_from_config(cfg) make them from the config)"
        )
    backend = resolve_backend(
        m.attention_backend,
        device=env.device,
        training=training,
        sinks_or_windows=m.attention_sinks or m.sliding_window,
    )
    vocab = padded_vocab(cfg.model, tokenizer_vocab)
    if vocab % env.tp_size:
        raise ConfigError(
            f"parallel.tensor_parallel_size={env.tp_size}: must divide the vocabulary's {vocab} rows (each TP rank "
            "holds an equal slice; set model.vocab_size to a multiple, or import a checkpoint whose vocabulary is one)"
        )
    fields = model_fields(cfg.model, vocab_size=vocab, max_seq_length=cfg.data.max_seq_length)
    bf16 = use_bf16(cfg.train.precision, env.device)
    hf_dir = cfg.model.hf_checkpoint
    stage = stage_names(cfg.model, env) if env.pp_size > 1 else None
    if stage is not None:  # the whole model's count (a stage's slices are counted by the summary)
        whole_meta = _meta_model(cfg, vocab, backend, env)
        num_parameters = whole_numel(record_layout(whole_meta, env.group("tp"), ep_size=env.ep_size), whole_meta)
    lora = m.lora.rank > 0
    if lora and empty:  # the checkpoint holds the adapters only: the base comes from its source
        empty = False
    adapters = ()
    if hf_dir or empty:
        model = _meta_model(cfg, vocab, backend, env, stage)
        adapters = tuple(n for n, _ in model.named_parameters() if is_adapter(n))
        _check_no_buffers(model)
        stage_count = whole_numel(
            record_layout(model, env.group("tp"), ep_size=env.ep_size), model
        )  # TP slices counted whole
        num_parameters = stage_count if stage is None else num_parameters
        apply_recompute(model, m.recompute_granularity)
        model = wrap_fsdp(model, env, bf16=bf16, expert_modules=place_experts(model, env))
        model.to_empty(device=env.device)
        if empty:
            source = "uninitialised (to be loaded by the caller)"
        elif fields.get("head") == "value" and not has_value_head(hf_dir):
            # a critic from a causal LM: its decoder, and a new head (the causal LM's lm_head unused)
            decoder_only = {**{k: v for k, v in fields.items() if k != "head"}, "tie_embeddings": True}
            load_hf_weights(model, hf_dir, decoder_only, skip=(*VALUE_HEAD, *adapters), stage=stage)
            if stage is None or stage.post:  # the head lives on the last pipeline stage
                init_value_head(model, std=cfg.model.init_method_std, seed=cfg.train.seed)
            source = (
                f"weights from {hf_dir}, value head initialised N(0, {cfg.model.init_method_std:g}) from train.seed"
            )
        else:
            load_hf_weights(model, hf_dir, fields, stage=stage, skip=adapters)
            source = f"weights from {hf_dir}"
    else:
        model = build_gpt(
            cfg.model,
            vocab_size=vocab,
            max_seq_length=cfg.data.max_seq_length,
            backend=backend,
            seed=cfg.train.seed,
            **_tp(env),
        )
        if stage is not None:  # the stage's part of the whole model of this seed (pipeline_stage)
            whole, model = model, _stage_model(cfg, vocab, backend, env, stage)
            copy_from_whole(model, whole, stage)
            del whole
        stage_count = whole_numel(
            record_layout(model, env.group("tp"), ep_size=env.ep_size), model
        )  # TP slices counted whole
        num_parameters = stage_count if stage is None else num_parameters
        apply_recompute(model, m.recompute_granularity)
        model = wrap_fsdp(model, env, bf16=bf16, expert_modules=place_experts(model, env))
        source = f"initialised from train.seed={cfg.train.seed}"
    if lora:
        source += "; " + start_adapters(model, cfg, stage)
    if stage is not None:
        model.stage_names = stage
        model.activation_dtype = torch.bfloat16 if bf16 else torch.float32  # what crosses between stages
        model.pipeline_group = env.group("pp")
        model.pipeline_order_rule = cfg.parallel.pipeline_order  # pipeline.pipeline_order
        # The whole model on the meta device (no storage): its names, shapes and dtypes for the
        # weight stream's metadata and receive buffers (pp_state.whole_model_tensors); kept out of
        # the module tree, or its meta tensors would join the stage's state dict.
        object.__setattr__(model, "whole_meta", whole_meta)
        model.stage_ranks = [env.stage_rank(s) for s in range(env.pp_size)]
        model.stage_splits = [env.dims.stage_range(s, m.num_layers) for s in range(env.pp_size)]
    if stage is None or stage.post:  # only the last stage has an output layer
        _configure_output(model, cfg, tokenizer_vocab=tokenizer_vocab, vocab=vocab)
    else:
        set_output_settings(model, OutputSettings())
    if env.is_main and stage is not None:
        log.info(
            "pipeline: %d stages, decoder layers %s (the first also embeds, the last runs the output layer)",
            env.pp_size,
            ", ".join(
                f"{a}-{a + n - 1}" for a, n in (env.dims.stage_range(s, m.num_layers) for s in range(env.pp_size))
            ),
        )
    if env.is_main:
        log.info(
            "model: %s parameters (%.3gB), %s layers, hidden %d, vocab %d, %s-style; %s; %s, %s",
            f"{num_parameters:,}",
            num_parameters / 1e9,
            cfg.model.num_layers,
            cfg.model.hidden_size,
            vocab,
            fields["model_type"] or "custom",
            source,
            "bf16" if bf16 else "fp32",
            backend if m.recompute_granularity == "none" else f"{backend}, recompute {m.recompute_granularity}",
        )
        limit = output_settings(model).vocab_limit
        if m.logits_chunk_tokens or limit:
            log.info(
                "output layer: %s%s",
                f"log-probabilities {m.logits_chunk_tokens} tokens at a time (model.logits_chunk_tokens)"
                if m.logits_chunk_tokens
                else "whole logits",
                f"; softmax over the tokenizer's {limit} ids of {vocab} rows" if limit else "",
            )
    return BuiltModel(model, backend, num_parameters, vocab, bf16, fields)
