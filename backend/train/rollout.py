"""What the policy loss reads beyond the rows: old log-probabilities recomputed once per rollout
batch, and a frozen reference model's log-probabilities, both filled into the training plan's own
microbatches (``forward_only.fill_logprobs``), so they sit exactly where the loss reads them.

``loss.minibatches_per_rollout = N`` trains a rollout batch of N windows as N optimizer steps.
With ``loss.old_logprobs=recompute`` the stream takes the N windows together, runs the current
weights forward-only over all of them (the policy that would have sampled them), then yields them
one by one: the first step's ratios are exactly 1 and the later ones differ from 1 by the updates
made since. The saved stream position is that of the last window yielded, never of the windows
held ahead, so a checkpoint at the end of a rollout batch resumes exactly.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from collections import deque
from pathlib import Path

from backend.checkpoint.lora_base import check_lora_checkpoint
from backend.checkpoint.store import load_model_weights, resolve_step_dir
from backend.config.schema import LoRAConfig
from backend.data.iterator import StepData
from backend.model.factory import build_model
from backend.model.lora import as_reference

from .forward_only import fill_logprobs

log = logging.getLogger(__name__)


def build_reference(cfg, env, *, tokenizer_vocab: int):
    """The frozen, FSDP2-sharded reference model of ``loss.reference_checkpoint``: a Hugging Face
    directory (``config.json``) or one of our checkpoints (a step_* directory or a checkpoint
    directory, its newest complete one; weights only, pickle-free). Same architecture as the policy."""
    source = Path(cfg.loss.reference_checkpoint)
    if (source / "config.json").is_file():
        # a Hugging Face model as it is: no adapters (the policy's model.lora does not apply to it)
        ref_model = dataclasses.replace(cfg.model, hf_checkpoint=str(source), lora=LoRAConfig())
        ref_cfg = dataclasses.replace(cfg, model=ref_model)
        model = build_model(ref_cfg, env, tokenizer_vocab=tokenizer_vocab, training=False).model
    else:
        step_dir = resolve_step_dir(source)
        model = build_model(cfg, env, tokenizer_vocab=tokenizer_vocab, training=False, empty=True).model
        check_lora_checkpoint(cfg, env, step_dir)
        load_model_weights(model, step_dir)
        source = step_dir
    model.requires_grad_(False)
    model.eval()
    if env.is_main:
        log.info("reference model (loss.reference_checkpoint): %s, frozen, forward-only", source)
    return model


def fill_window(data: StepData, env, *, policy=None, reference=None, temperature: float = 1.0) -> None:
    """``old_logprobs`` from ``policy`` and ``ref_logprobs`` from ``reference`` (either may be None)
    filled into the window's own microbatches, under its plan, at the sampling ``temperature``
    (``loss.temperature``), for the file stream and the RL worker alike. With LoRA the reference
    may be the policy itself, run with its adapters off (``lora.as_reference``)."""
    if policy is not None:
        fill_logprobs(policy, data.microbatches, env, "old_logprobs", temperature=temperature)
    if reference is not None:
        with as_reference(reference):
            fill_logprobs(reference, data.microbatches, env, "ref_logprobs", temperature=temperature)


class RolloutStream:
    """Windows for the trainer, with the policy loss's log-probabilities filled in.

    Wraps the data iterator: takes ``windows_per_rollout`` windows at a time when old
    log-probabilities are recomputed (else one), fills ``old_logprobs`` from ``policy`` and
    ``ref_logprobs`` from ``reference`` as configured, and yields them in order. ``last_fill_s``
    is the time the forward-only passes of the last rollout batch took."""

    def __init__(
        self, iterator, env, *, policy=None, reference=None, windows_per_rollout: int = 1, temperature: float = 1.0
    ):
        self.iterator, self.env = iterator, env
        self.policy, self.reference = policy, reference
        self.temperature = temperature
        self.windows = windows_per_rollout if policy is not None else 1
        self.pending: deque[tuple[StepData, dict]] = deque()
        self.state: dict | None = None
        self.last_fill_s = 0.0
        self.last_wait_s = 0.0  # waiting for windows from the iterator in the last next()

    def __iter__(self):
        return self

    def __next__(self) -> StepData:
        self.last_wait_s = 0.0
        if not self.pending:
            batch = []
            for _ in range(self.windows):
                data = next(self.iterator)
                self.last_wait_s += getattr(self.iterator, "last_wait_s", 0.0)
                batch.append((data, self.iterator.state_dict()))  # a fresh dict per call
            start = time.perf_counter()
            for data, _ in batch:
                fill_window(data, self.env, policy=self.policy, reference=self.reference, temperature=self.temperature)
            self.last_fill_s = time.perf_counter() - start
            self.pending.extend(batch)
        data, self.state = self.pending.popleft()
        return data

    @property
    def at_rollout_start(self) -> bool:
        """True when the next window starts a rollout batch (nothing is held ahead)."""
        return not self.pending

    def state_dict(self) -> dict:
        """The stream position after the last window yielded (windows held ahead are not counted)."""
        return copy.deepcopy(self.state) if self.state is not None else self.iterator.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.pending.clear()
        self.iterator.load_state_dict(state)
        self.state = copy.deepcopy(state)
