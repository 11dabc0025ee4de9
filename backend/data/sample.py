"""One training sample and the dataset interface every source implements."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import numpy as np

# Per-token float fields of policy-gradient rows (loss.type=policy), aligned like loss_mask.
POLICY_FIELDS = ("advantages", "old_logprobs", "ref_logprobs", "rollout_logprobs", "returns", "old_values")


@dataclass
class Sample:
    """Token ids plus optional per-token arrays aligned with the tokens.

    ``loss_mask[t]`` says whether token t is a prediction target (predicted at position t-1);
    ``loss_weight[t]`` scales its loss. Missing means all ones. The policy fields (RL rows:
    ``advantages``, the old policy's ``old_logprobs``, the reference model's ``ref_logprobs``, the
    sampler's own ``rollout_logprobs``) follow
    the same rule: entry t belongs to token t as a target, entry 0 is never used, and values where
    the loss mask is 0 are never read (they may be NaN).
    """

    tokens: np.ndarray
    loss_mask: np.ndarray | None = None
    loss_weight: np.ndarray | None = None
    advantages: np.ndarray | None = None
    old_logprobs: np.ndarray | None = None
    ref_logprobs: np.ndarray | None = None
    rollout_logprobs: np.ndarray | None = None  # the sampler's own (what it drew the token with)
    returns: np.ndarray | None = None  # a critic's targets (loss.type=value)
    old_values: np.ndarray | None = None  # the values the rollout recorded (the value clip's centre)

    def __post_init__(self) -> None:
        n = len(self.tokens)
        for name in ("loss_mask", "loss_weight", *POLICY_FIELDS):
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise ValueError(f"{name} has {len(value)} entries for {n} tokens")

    def loss_tokens(self) -> int:
        """Targets in this sample: tokens 1..n-1 whose loss mask is set."""
        if len(self.tokens) < 2:
            return 0
        if self.loss_mask is None:
            return len(self.tokens) - 1
        return int(np.count_nonzero(self.loss_mask[1:]))

    def truncated(self, n: int) -> Sample:
        """The first ``n`` tokens, every per-token array cut alike."""
        if len(self.tokens) <= n:
            return self
        return Sample(
            **{f.name: None if (v := getattr(self, f.name)) is None else v[:n] for f in dataclasses.fields(self)}
        )

    def appended(self, token: int) -> Sample:
        """``token`` after the last one; the other per-token arrays repeat their last entry."""

        def extend(arr, value):
            return None if arr is None else np.append(arr, np.asarray([value], dtype=arr.dtype))

        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out = {k: extend(v, v[-1]) if k != "tokens" and v is not None else v for k, v in out.items()}
        out["tokens"] = extend(self.tokens, token)
        return Sample(**out)


class TokenDataset(Protocol):
    """Random access to samples, with every length known without reading tokens."""

    lengths: np.ndarray  # int64, tokens per sample
    loss_token_counts: np.ndarray  # int64, prediction targets per sample
    source: str  # a file name or description, for error messages
    has_loss_weight: bool  # any sample carries per-token loss weights

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Sample: ...
