"""One training sample and the dataset interface every source implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass
class Sample:
    """Token ids plus optional per-token loss mask and loss weight, aligned with the tokens.

    ``loss_mask[t]`` says whether token t is a prediction target (predicted at position t-1);
    ``loss_weight[t]`` scales its loss (e.g. an RL advantage). Missing means all ones.
    """

    tokens: np.ndarray
    loss_mask: np.ndarray | None = None
    loss_weight: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = len(self.tokens)
        for name in ("loss_mask", "loss_weight"):
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


class TokenDataset(Protocol):
    """Random access to samples, with every length known without reading tokens."""

    lengths: np.ndarray  # int64, tokens per sample
    loss_token_counts: np.ndarray  # int64, prediction targets per sample
    source: str  # a file name or description, for error messages
    has_loss_weight: bool  # any sample carries per-token loss weights (RL advantages)

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Sample: ...
