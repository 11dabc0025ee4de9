"""Which config changes a resumed run may make: a pure comparison of two config dicts.

A resumed run must continue the *same* run: the same model and the same data stream. Anything
else (how the stream is cut into microbatches, the optimizer's hyperparameters, where logs go)
may change, and each change is reported. Both inputs are ``dataclasses.asdict(Config)``-shaped
(sections ``model, parallel, data, train, optimizer, scheduler, checkpoint, logger``); nested
sections compare as dotted keys (``logger.wandb.project``).

Refused (the checkpoint would continue a different run):

- ``model.*`` except ``model.attention_backend``, ``model.recompute_granularity`` and
  ``model.logits_chunk_tokens`` (how the output layer is evaluated, not what it is): the
  architecture, vocabulary or initialisation of the checkpointed weights. The attention backend is
  an implementation of the same function (te, flex and sdpa agree to float rounding), so it may
  change, e.g. a CPU run resumed on a GPU; recomputation trades memory for time and changes no value.
- ``data.path``, ``data.tokenizer``, ``data.json_key``, ``data.max_seq_length``, ``data.overlong``,
  ``data.append_eod``: which samples exist and their tokens; the saved stream position would index
  other samples.
- ``train.global_batch_size``, ``train.seed``: the window sampler's stream (windows are consecutive
  slices of seeded per-epoch permutations); ``WindowSampler.load_state_dict`` refuses them too.
- ``parallel.context_parallel_size``: the CP layout of the plans and of the checkpoint.
  (The data-parallel size is not a config key; ``load_checkpoint`` compares it.)
- any key the policy does not know (a new config field): refused until classified here, since a
  silent change of an unknown kind is the failure this module exists to prevent.

Allowed, reported:

- ``optimizer.*``, ``scheduler.*``, ``train.train_iters`` (extending a run; the cosine decay then
  follows the new horizon from the current step), ``logger.*``, ``checkpoint.*``, ``data.cache_dir``.
- Microbatching: ``train.micro_batch_size`` and the dynamic-batching knobs (``dynamic_batch_*``,
  ``max_tokens_per_gpu``, ``forward_max_tokens_per_gpu``). They decide how a window is cut into
  microbatches, not which samples the window holds (the sampler does) nor the gradient: the loss
  is the sum of token losses divided by the window's global target-token count, so every plan of
  the same window gives the same gradient up to floating-point summation order (compare_arms
  measures it). Resuming with a larger budget on a bigger GPU is the common case.
- ``train.precision``: FSDP2 keeps FP32 master weights and FP32 AdamW state whatever the precision
  (BF16 is only the compute dtype of ``MixedPrecisionPolicy``), so the checkpoint loads unchanged;
  only the arithmetic of later steps changes, e.g. a CPU (fp32) run resumed on a GPU (bf16 under
  ``auto`` anyway). Reported so the change in loss noise has an explanation.
- ``parallel.backend``, ``parallel.data_parallel_wrapper``: transport and wrapper (one choice today).
- ``parallel.expert_parallel_size``: which rank holds which expert. A checkpoint stores each
  stacked expert tensor once at its global shape [E, ...] (DCP records every shard's offset), so a
  run saved at EP 2 resumes at another EP size in a world of the same size (EP 2 -> 1 tested)
  and its gradient is the same function of the weights.
- ``parallel.tensor_parallel_size`` / ``parallel.sequence_parallel``: a checkpoint stores every
  split tensor whole (``tp_state``: the TP 1 layout), so TP 2 resumes at TP 1 in a world of the
  same size (tested); the data-parallel size that changes with it (world / (cp x tp)) deals the
  same windows over more or fewer ranks.
- ``loss.*`` except ``loss.type``: the policy loss's hyperparameters (like the optimizer's); a
  change of ``loss.type`` itself is refused (another objective, another run).
- ``rl.*`` except ``rl.prompts`` and ``rl.prompts_per_step`` (refused: the saved position of the
  RL loop's prompt stream indexes that file at that rate): sampling, reward and advantage settings.
- A key missing from the old config (a checkpoint from before the key existed) is allowed, with a
  note; so is a key missing from the new one (removed since). The missing side's value is ``MISSING``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from backend.errors import CheckpointError


class _Missing:
    """The value of a key one config does not have (shown as ``(absent)``)."""

    def __repr__(self) -> str:
        return "(absent)"


MISSING = _Missing()

# Keys refused outright, and the reason shown.
_REFUSED_KEYS = {
    "data.path": "the data set",
    "data.blend": "the blended data sets and their weights",
    "data.tokenizer": "the tokens of every sample",
    "data.json_key": "the text of every JSONL sample",
    "data.max_seq_length": "which samples exist and their lengths",
    "data.overlong": "which samples exist and their lengths",
    "data.append_eod": "the tokens of every sample and the vocabulary",
    "data.embedded_cut_lines": "which samples exist and their lengths",
    "train.global_batch_size": "the data stream (samples per window)",
    "train.seed": "the data stream (the sampler's permutations)",
    "parallel.context_parallel_size": "the context-parallel layout",
    "data.valid_fraction": "which samples the training stream holds (the validation split)",
    "loss.type": "the training objective (cross-entropy or the policy loss)",
    "rl.prompts": "the RL loop's prompt stream (its saved position would index other prompts)",
    "rl.prompts_per_step": "the RL loop's prompt stream (prompts per step)",
}
_ALLOWED_KEYS = {
    "model.attention_backend": "the same attention, another implementation",
    "parallel.pipeline_parallel_size": "how the layers are cut into stages; checkpoints hold the whole model",
    "parallel.pipeline_layers": "how the layers are cut into stages; checkpoints hold the whole model",
    "parallel.pipeline_order": "the order microbatches enter the pipeline (summation order only)",
    "model.recompute_granularity": "memory for time; the same activations, the same gradient",
    "model.logits_chunk_tokens": "memory for time; the same log-probabilities to FP32 rounding",
    "model.logits_fused_kernel": "another kernel for the same cross-entropy, to FP32 rounding",
    "train.train_iters": "the run's length; the LR schedule follows the new horizon from here",
    "train.micro_batch_size": "microbatching only; same windows, same gradient",
    "train.dynamic_batch_enable": "microbatching only; same windows, same gradient",
    "train.max_tokens_per_gpu": "microbatching only; same windows, same gradient",
    "train.dynamic_batch_pad_to_multiple": "microbatching only; same windows, same gradient",
    "train.dynamic_batch_max_shapes": "microbatching only; same windows, same gradient",
    "train.dynamic_batch_overhead": "microbatching only; same windows, same gradient",
    "train.dynamic_batch_layout": "microbatching only; same windows, same gradient",
    "train.dynamic_batch_attention_weight": "microbatching only; same windows, same gradient",
    "train.forward_max_tokens_per_gpu": "forward-only passes' microbatching",
    "train.memory_limit_gib": "only the measured token budget (microbatching) follows from it",
    "train.memory_margin": "only the measured token budget (microbatching) follows from it",
    "train.memory_meter": "whether each step's peak memory is measured, nothing else",
    "train.precision": "compute dtype only; FP32 master weights and optimizer state load unchanged",
    "data.cache_dir": "where caches live",
    "data.prefetch": "when the next window is prepared, not which one",
    "data.valid_path": "what is evaluated, not what is trained",
    "train.eval_interval": "when validation runs",
    "train.eval_samples": "what is evaluated, not what is trained",
    "train.nonfinite": "what a step that is not finite does",
    "train.nonfinite_max_skips": "what a step that is not finite does",
    "parallel.backend": "the collective transport",
    "parallel.data_parallel_wrapper": "the data-parallel wrapper",
    "parallel.expert_parallel_size": "where experts live; checkpoints hold every expert once, by global index",
    "parallel.tensor_parallel_size": "how layers are split; checkpoints hold whole tensors (the TP 1 layout)",
    "parallel.sequence_parallel": "where activations live between the TP regions, not the weights",
}
_REFUSED_SECTIONS = {"model.": "the model's architecture or weights"}
_ALLOWED_SECTIONS = {
    "optimizer.": "optimizer hyperparameters",
    "scheduler.": "the learning-rate schedule",
    "logger.": "logging",
    "checkpoint.": "checkpointing",
    "loss.": "the policy loss's hyperparameters (clips, coefficients, sources of log-probabilities)",
    "rl.": "the RL loop's sampling, reward and advantage settings (the prompt stream excepted)",
}


@dataclass
class ResumeDiff:
    """Changed keys, split by policy; each entry is (dotted key, old value, new value)."""

    refused: list[tuple[str, Any, Any]] = field(default_factory=list)
    allowed: list[tuple[str, Any, Any]] = field(default_factory=list)
    reasons: dict[str, str] = field(default_factory=dict)  # dotted key -> why refused / what it changes
    notes: list[str] = field(default_factory=list)  # keys missing on one side

    @property
    def ok(self) -> bool:
        return not self.refused

    def message(self, checkpoint: str = "the checkpoint") -> str:
        """One line for the refusal: every refused key with both values and what it would change."""
        parts = [f"{k}: {old!r} -> {new!r} ({self.reasons[k]})" for k, old, new in self.refused]
        return (
            f"{checkpoint}: refusing to resume with a changed {', '.join(parts)}; restore these keys, or start a "
            f"new run (another checkpoint.dir, or checkpoint.resume=false)"
        )

    def summary(self) -> list[str]:
        """Log lines for what changed and was accepted."""
        lines = [f"{k}: {old!r} -> {new!r} ({self.reasons[k]})" for k, old, new in self.allowed]
        return lines + self.notes


class ResumeConfigError(CheckpointError):
    """The run's config changes what the checkpoint's run was (its model or its data stream)."""


def flatten(config: dict, prefix: str = "") -> dict[str, Any]:
    """Nested sections to dotted keys; lists and other values are leaves."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{dotted}."))
        else:
            out[dotted] = value
    return out


def classify(key: str) -> tuple[bool, str]:
    """(allowed, reason) for a dotted key."""
    if key in _ALLOWED_KEYS:
        return True, _ALLOWED_KEYS[key]
    if key in _REFUSED_KEYS:
        return False, _REFUSED_KEYS[key]
    for prefix, reason in _REFUSED_SECTIONS.items():
        if key.startswith(prefix):
            return False, reason
    for prefix, reason in _ALLOWED_SECTIONS.items():
        if key.startswith(prefix):
            return True, reason
    return False, "a key the resume policy does not classify yet (backend/checkpoint/resume_policy.py)"


def diff_resume_config(old: dict, new: dict, *, unread: tuple[str, ...] = ()) -> ResumeDiff:
    """Compare the checkpoint's config (``old``) with this run's (``new``). Pure; never raises.
    ``unread``: keys this run's driver never reads (an RL worker's ``train.global_batch_size``: its
    windows are the rows handed over), allowed and reported whatever their class."""
    flat_old, flat_new = flatten(old), flatten(new)
    diff = ResumeDiff()
    for key in sorted(flat_old.keys() | flat_new.keys()):
        before, after = flat_old.get(key, MISSING), flat_new.get(key, MISSING)
        if before == after:
            continue
        if before is MISSING:
            diff.allowed.append((key, before, after))
            diff.reasons[key] = "not in the checkpoint's config (written before the key existed)"
            diff.notes.append(f"{key}: absent from the checkpoint's config; using {after!r}")
            continue
        if after is MISSING:
            diff.allowed.append((key, before, after))
            diff.reasons[key] = "no longer a config key"
            diff.notes.append(f"{key}: in the checkpoint's config ({before!r}) but no longer a key; ignored")
            continue
        allowed, reason = (True, "not read by this run's driver") if key in unread else classify(key)
        diff.reasons[key] = reason
        (diff.allowed if allowed else diff.refused).append((key, before, after))
    return diff


def check_resume_config(old: dict, new: dict, *, checkpoint: str = "the checkpoint") -> ResumeDiff:
    """``diff_resume_config``, raising ResumeConfigError (a user error) when anything is refused."""
    diff = diff_resume_config(old, new)
    if diff.refused:
        raise ResumeConfigError(diff.message(checkpoint))
    return diff
