"""Build megatron-core's ``GPTModel`` (Llama / Qwen3 / Qwen2 / GPT-OSS style) with our core attention.

GPT-OSS (``model.num_moe_experts`` > 0, ``attention_sinks``, ``sliding_window``): megatron-core's
MoE layer on its CPU-safe path (``moe_compat``: TopKRouter, allgather dispatcher) with our stacked
``grouped_experts`` in its experts slot (biases and the clamped SwiGLU, grouped GEMMs), ``softmax_type="learnable"`` (our core attention
holds the sinks as ``softmax_offset``), ``window_size=(W - 1, 0)`` with a per-layer
``window_attn_skip_freq`` list. megatron-core's own load-balancing loss is off: the aux loss is
ours, per sequence and normalised per window (``moe_stats``), so fixed and dynamic plans agree.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backend.config.run_values import ffn_size
from backend.megatron_compat import import_megatron_module

from .attention import core_attention_spec
from .fields import head_dim, is_value_head, layer_flags
from .rope import Rope

# Fusions and CUDA-only paths off: the same megatron-core modules run on CPU and GPU.
PORTABLE_FUSIONS_OFF = dict(
    masked_softmax_fusion=False,
    bias_dropout_fusion=False,
    apply_rope_fusion=False,
    persist_layer_norm=False,
    gradient_accumulation_fusion=False,
    cross_entropy_loss_fusion=False,
)


def build_gpt(
    model_cfg,
    *,
    vocab_size: int,
    max_seq_length: int,
    backend: str,
    seed: int,
    tp: int = 1,
    sequence_parallel=False,
    stage: tuple[int, int] | None = None,
):
    """A GPTModel in FP32 (the wrapper moves and casts it). Same seed -> same weights.

    ``stage`` (first layer, layer count): one pipeline stage, decoder layers ``first ..
    first + count - 1`` only, the embedding when it starts at layer 0 and the final norm and output
    layer when it ends at the last (megatron-core's ``pre_process`` / ``post_process``), each
    layer's window flag its global layer's. Its weights are not the whole model's of the same seed:
    ``pipeline_stage.stage_of`` copies them from the whole model (or a checkpoint fills them).
    A tied output layer on a last stage without the embedding is its own parameter (kept equal to
    the first stage's embedding by summing their gradients: ``backend.distributed.pipeline``).

    ``tp`` > 1 (megatron-core's parallel state holds a TP group of that size): every linear layer,
    the embedding and the output layer are megatron-core's tensor-parallel layers holding this
    rank's slice. Their CPU initialisation draws each whole weight from the seed and keeps the
    slice, so a TP 2 model holds exactly the halves of the TP 1 model of the same seed.

    Built on the CPU, or on the meta device when called under ``with torch.device("meta")``
    (storage-free: a Hugging Face import fills the shards afterwards, so a 4B model is never
    randomly initialised in full on every rank; the local spec's CPU init runs on meta tensors).
    """
    te_cfg = import_megatron_module("megatron.core.transformer")
    gpt = import_megatron_module("megatron.core.models.gpt")
    specs = import_megatron_module("megatron.core.models.gpt.gpt_layer_specs")
    kwargs = dict(
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=model_cfg.qkv_bias,
        bias_activation_fusion=False,
    )
    experts = model_cfg.num_moe_experts
    if experts:
        from .moe_compat import apply_moe_compat, moe_config_kwargs

        apply_moe_compat()
        kwargs |= moe_config_kwargs(
            num_experts=experts,
            topk=model_cfg.moe_router_topk,
            moe_ffn_hidden_size=model_cfg.moe_ffn_hidden_size or ffn_size(model_cfg),
            swiglu_limit=model_cfg.swiglu_limit,
            swiglu_alpha=model_cfg.swiglu_alpha,
            aux_loss_coeff=0.0,  # ours instead (moe_stats): per sequence, normalised per window
        )
    if model_cfg.attention_bias:
        if not experts:
            raise ValueError("model.attention_bias without experts: megatron-core would bias the dense MLP too")
        kwargs |= dict(add_bias_linear=True, add_qkv_bias=True)
    if model_cfg.attention_sinks:
        kwargs["softmax_type"] = "learnable"
    first, count = stage if stage is not None else (0, model_cfg.num_layers)
    pre, post = first == 0, first + count == model_cfg.num_layers
    if model_cfg.sliding_window:
        flags = layer_flags(model_cfg)[first : first + count]
        kwargs |= dict(window_size=(model_cfg.sliding_window - 1, 0), window_attn_skip_freq=flags)
    if tp > 1:
        from .tp_compat import apply_tp_compat

        apply_tp_compat()
        kwargs |= dict(tensor_model_parallel_size=tp, sequence_parallel=bool(sequence_parallel))
    if "cuda_graph_scope" in te_cfg.TransformerConfig.__dataclass_fields__:
        # Its default "full" is deprecated and warns on every build; [] is the same (no graphs here).
        kwargs["cuda_graph_scope"] = []
    config = te_cfg.TransformerConfig(
        num_layers=count,
        hidden_size=model_cfg.hidden_size,
        num_attention_heads=model_cfg.num_attention_heads,
        num_query_groups=model_cfg.num_query_groups,
        ffn_hidden_size=ffn_size(model_cfg),
        kv_channels=head_dim(model_cfg),
        normalization="RMSNorm",
        layernorm_epsilon=float(model_cfg.norm_epsilon),
        qk_layernorm=model_cfg.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=model_cfg.init_method_std,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        **PORTABLE_FUSIONS_OFF,
        **kwargs,
    )
    spec = specs.get_gpt_layer_local_spec(
        num_experts=experts or None,
        moe_grouped_gemm=False,
        qk_layernorm=model_cfg.qk_layernorm,
        normalization="RMSNorm",
    )
    if tp > 1:  # norms that run beside sequence parallelism (megatron-core's torch norm refuses it)
        from .tensor_parallel import torch_norm_class

        norm = torch_norm_class()
        spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = norm
        if model_cfg.qk_layernorm:
            attention = spec.submodules.self_attention.submodules
            attention.q_layernorm = attention.k_layernorm = norm
    max_positions = model_cfg.max_position_embeddings or max_seq_length
    rope = Rope.from_config(model_cfg, head_dim=config.kv_channels, max_position_embeddings=max_positions)
    spec.submodules.self_attention.submodules.core_attention = core_attention_spec(backend, rope)
    if experts:  # stacked experts, one grouped GEMM per projection (grouped_experts), not SequentialMLP
        from .grouped_experts import experts_spec

        spec.submodules.mlp.submodules.experts = experts_spec()
    cpu_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        if tp > 1:  # the block's final norm too
            block = import_megatron_module("megatron.core.transformer.transformer_block")
            spec = block.TransformerBlockSubmodules(layer_specs=[spec] * count, layer_norm=norm)
        model = gpt.GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=vocab_size,
            max_sequence_length=max_positions,
            # RoPE is applied inside our core attention from global positions (CP-safe, CPU-safe).
            position_embedding_type="none",
            share_embeddings_and_output_weights=model_cfg.tie_embeddings
            and not is_value_head(model_cfg)
            and pre
            and post,
            pre_process=pre,
            post_process=post,
        )
        if is_value_head(model_cfg) and post:  # the last pipeline stage's, or the whole model's
            # A critic: a scalar head (hidden -> 1, with a bias, as transformers' token
            # classification ``score``) in place of the vocabulary projection; same name, so the
            # output path and FSDP2 wrapping are unchanged. Weight ~ N(0, init_method_std), bias 0.
            if tp > 1:  # one output does not split: every TP rank holds the whole head (value_head.py)
                from .value_head import ReplicatedValueHead

                model.output_layer = ReplicatedValueHead(config)
            else:
                tensor_parallel = import_megatron_module("megatron.core.tensor_parallel")
                model.output_layer = tensor_parallel.ColumnParallelLinear(
                    config.hidden_size,
                    1,
                    config=config,
                    init_method=config.init_method,
                    bias=True,
                    skip_bias_add=False,
                    gather_output=False,
                )
    finally:
        torch.random.set_rng_state(cpu_state)
    if experts:
        from .moe_stats import install

        install(model, model_cfg.moe_aux_loss_coeff)
    if model_cfg.lora.rank:  # adapters beside the targeted layers, the rest frozen (values: lora.init_adapters)
        from .lora import attach, freeze_base

        geometry = dict(
            num_attention_heads=model_cfg.num_attention_heads,
            num_query_groups=model_cfg.num_query_groups,
            head_dim=config.kv_channels,
        )
        attach(model, model_cfg.lora, fields=geometry, tp=tp, sequence_parallel=bool(sequence_parallel))
        freeze_base(model, value_head=is_value_head(model_cfg))
    return model
