"""The config schema: one dataclass per concern, each field documented.

The dataclasses hold no checks: OmegaConf builds them field by field while merging YAML layers
and overrides, so every check (single values and cross-section rules alike) runs once, after the
last override, in ``validate.validate``, which names each offending dotted key.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from backend.batching import DEFAULT_ATTENTION_WEIGHT, DEFAULT_MICROBATCH_OVERHEAD, LAYOUTS

# Core attention kernels (backend.model.attention); "auto" picks one of them and logs why.
ATTENTION_KERNELS = ("te", "flex", "sdpa")
ATTENTION_BACKENDS = ("auto", *ATTENTION_KERNELS)
OVERLONG_POLICIES = ("error", "truncate", "drop")
WANDB_MODES = ("online", "offline", "disabled")
PRECISIONS = ("auto", "fp32", "bf16")
BATCH_LAYOUTS = LAYOUTS  # train.dynamic_batch_layout: padded | packed
DP_WRAPPERS = ("fsdp",)


@dataclass
class ModelConfig:
    """A Llama / Qwen3-style decoder: RMSNorm, SwiGLU, RoPE, grouped-query attention."""

    num_layers: int = 2
    hidden_size: int = 128
    num_attention_heads: int = 4
    # Key/value heads for grouped-query attention; must divide num_attention_heads.
    num_query_groups: int = 2
    # SwiGLU inner size; 0 means 8/3 * hidden_size rounded up to a multiple of 64.
    ffn_hidden_size: int = 0
    # 0 means "from the tokenizer" (padded up to a multiple of 128).
    vocab_size: int = 0
    # Longest position RoPE is set up for; 0 means data.max_seq_length.
    max_position_embeddings: int = 0
    rotary_base: int = 10000
    # RMSNorm on queries and keys (Qwen3).
    qk_layernorm: bool = True
    init_method_std: float = 0.02
    # auto: te when Transformer Engine imports and CUDA is present, flex on CUDA, sdpa on CPU.
    attention_backend: str = "auto"
    # Tie input embedding and output layer weights.
    tie_embeddings: bool = True


@dataclass
class ParallelConfig:
    # Context-parallel size: each sequence is cut into 2*cp chunks, two per CP rank.
    context_parallel_size: int = 1
    # Data-parallel wrapper: torch FSDP2 (fully_shard) over the data x context parallel group.
    data_parallel_wrapper: str = "fsdp"
    # Process-group backend: "auto" is nccl on CUDA, gloo on CPU.
    backend: str = "auto"


@dataclass
class DataConfig:
    # "embedded" (the standard library's source, built on first use), a JSONL file, or the
    # prefix of a Megatron .bin/.idx pair.
    path: str = "embedded"
    # "byte" (built in, no files) or the path of a Hugging Face tokenizer.json.
    tokenizer: str = "byte"
    # The JSONL field holding text (token ids go under "input_ids" instead).
    json_key: str = "text"
    # Longest sample, in tokens; longer ones follow ``overlong``.
    max_seq_length: int = 2048
    # error: stop, naming the sample; truncate: cut to max_seq_length; drop: skip. Counted either way.
    overlong: str = "error"
    # Where the embedded data set and tokenised JSONL caches are written.
    cache_dir: str = "data_cache"


@dataclass
class TrainConfig:
    # Samples per optimizer step (all data-parallel ranks together).
    global_batch_size: int = 32
    # Samples per microbatch on one rank when dynamic batching is off.
    micro_batch_size: int = 1
    # Plan microbatches under max_tokens_per_gpu instead of micro_batch_size.
    dynamic_batch_enable: bool = False
    # Token budget per GPU and microbatch, padding included, after the CP cut.
    max_tokens_per_gpu: int = 0
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
    seed: int = 1234
    # auto: bf16 on CUDA, fp32 on CPU.
    precision: str = "auto"


@dataclass
class OptimizerConfig:
    lr: float = 3e-4
    min_lr: float = 3e-5
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    # Clip the global gradient norm to this value; 0 turns clipping off.
    clip_grad: float = 1.0


@dataclass
class SchedulerConfig:
    # Linear warmup steps, then cosine decay to optimizer.min_lr at train.train_iters.
    warmup_iters: int = 2


@dataclass
class CheckpointConfig:
    # Directory for checkpoints; empty means <logger.run_dir>/checkpoints.
    dir: str = ""
    # Save every N optimizer steps (0: only at the end).
    interval: int = 0
    # Complete checkpoints to keep (0: all).
    keep_last: int = 2
    # Resume from the newest complete checkpoint in dir when there is one.
    resume: bool = True
    # Allow resuming with a different data-parallel size (changes the data order).
    allow_dp_change: bool = False


@dataclass
class WandbConfig:
    enable: bool = False
    project: str = "dynbatch"
    entity: str = ""
    name: str = ""
    group: str = ""
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
