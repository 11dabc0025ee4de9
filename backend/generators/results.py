"""What every generator returns: sampled responses, a step's rollouts, a weight sync's numbers."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Completion:
    """One sampled response: its token ids (up to and including a stop id, if one came) and the
    sampler's log-probability of each, log softmax(logits / T)[token]."""

    token_ids: list[int]
    logprobs: list[float]
    stopped: bool  # ended on a stop id (else it ran to max_new_tokens)


@dataclass
class SyncStats:
    tensors: int
    bytes: int
    seconds: float

    def plus(self, other: SyncStats) -> SyncStats:
        """Two loads of one sync (the base, then LoRA adapters) as one."""
        return SyncStats(self.tensors + other.tensors, self.bytes + other.bytes, self.seconds + other.seconds)


@dataclass
class Rollout:
    """One step's generation as an asynchronous generator returns it: per prompt, its completions
    as (token ids, log-probabilities, stopped); the weight version it sampled with; its timings."""

    step: int
    version: int
    completions: list
    generate_s: float
    generator_idle_s: float
