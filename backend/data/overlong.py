"""Samples longer than ``data.max_seq_length``: error (default), truncate or drop; always counted."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from .errors import DataFileError, OverlongError
from .sample import Sample

__all__ = ["LengthLimitedDataset", "OverlongError", "OverlongReport"]

log = logging.getLogger(__name__)


@dataclass
class OverlongReport:
    max_seq_length: int
    policy: str
    truncated: int = 0
    dropped: int = 0
    truncated_tokens: int = 0

    def as_dict(self) -> dict:
        return {
            "overlong_policy": self.policy,
            "overlong_truncated": self.truncated,
            "overlong_dropped": self.dropped,
            "overlong_truncated_tokens": self.truncated_tokens,
        }


class LengthLimitedDataset:
    """A view of ``base`` in which no sample exceeds ``max_seq_length`` tokens."""

    def __init__(self, base, max_seq_length: int, policy: str):
        self.base = base
        self.source = base.source
        self.has_loss_weight = getattr(base, "has_loss_weight", False)
        self.ignored_fields = getattr(base, "ignored_fields", {})
        self.note = getattr(base, "note", "")  # how the source was prepared (documents cut), for the summary
        self.max_seq_length = max_seq_length
        lengths = np.asarray(base.lengths, dtype=np.int64)
        if len(lengths) == 0:
            raise DataFileError(f"{base.source}: no samples; point data.path at a data set that has some")
        over = np.flatnonzero(lengths > max_seq_length)
        self.report = OverlongReport(max_seq_length, policy)
        if len(over) and policy == "error":
            first = int(over[0])
            raise OverlongError(
                f"{base.source}: sample {first} has {int(lengths[first])} tokens, over data.max_seq_length="
                f"{max_seq_length} ({len(over)} sample(s) in all); set data.overlong to truncate or drop, or "
                f"raise data.max_seq_length"
            )
        counts = np.asarray(base.loss_token_counts, dtype=np.int64).copy()
        if policy == "drop":
            self.ids = np.setdiff1d(np.arange(len(lengths)), over)
            self.report.dropped = len(over)
        else:
            self.ids = np.arange(len(lengths))
            self.report.truncated = len(over)
            self.report.truncated_tokens = int((lengths[over] - max_seq_length).sum())
            for i in over:  # recount targets of the truncated samples only
                counts[i] = self._cut(base[int(i)]).loss_tokens()
        self.lengths = np.minimum(lengths[self.ids], max_seq_length)
        self.loss_token_counts = counts[self.ids]
        if len(over) and policy != "error":  # chosen on purpose: counted (start-up summary, metrics), not warned
            log.info(
                "%s: %d sample(s) over data.max_seq_length=%d were %s",
                base.source,
                len(over),
                max_seq_length,
                "dropped" if policy == "drop" else "truncated",
            )
        if len(self.ids) == 0:
            raise OverlongError(f"{base.source}: every sample is over data.max_seq_length={max_seq_length}")

    def _cut(self, s: Sample) -> Sample:
        return s.truncated(self.max_seq_length)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> Sample:
        return self._cut(self.base[int(self.ids[int(index)])])
