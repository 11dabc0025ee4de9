"""Microbatch tensors: right-padded to the microbatch's local padded length, then cut for CP.

Context parallelism splits each padded row into 2*cp chunks; CP rank i keeps chunks i and
2cp-1-i, so every CP rank gets the same share of causal-attention work. Position ids are cut the
same way and stay global.

A packed microbatch (``Microbatch.packed``) is one row: its sequences back to back, each padded
to a multiple of 2*cp (the row's tail padding joins the last), positions restarting at 0 per
sequence, no label across a sequence boundary. Under CP every SEQUENCE is cut into 2*cp chunks
and rank i keeps chunks i and 2cp-1-i of each (Transformer Engine's THD layout). The tensors
carry the segment facts attention needs: per-token sequence ids and cu_seqlens (real and padded).

Per-token policy fields (advantages, old/ref log-probabilities) are shifted like the labels (the
value at position t belongs to the target token t+1) and cut exactly like ``loss_weight``; so is
``sequence_targets``, the loss-token count of the sequence a position belongs to, which the
policy loss's per-sequence normalisation reads (the whole sequence's count, even under CP).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from backend.batching import Microbatch, cp_ranges, segment_lengths

from .sample import POLICY_FIELDS, Sample


@dataclass
class MicrobatchTensors:
    """One microbatch on one GPU. Shapes are [rows, padded_len / cp]; an empty one has 0 rows."""

    tokens: torch.Tensor  # int64 input ids, 0 at padding
    labels: torch.Tensor  # int64 next-token targets, 0 where there is none
    loss_mask: torch.Tensor  # float32 1 where the position's label counts
    loss_weight: torch.Tensor  # float32 per-position weight (loss_mask * sample weight)
    position_ids: torch.Tensor  # int64 global positions
    valid: torch.Tensor  # bool: a real token (padding is never attended)
    seq_lengths: torch.Tensor  # int64 [rows] real lengths before padding
    sample_ids: torch.Tensor  # int64 [rows] dataset indices
    padded_len: int  # row length before the CP cut
    # Policy-gradient fields, float32 like loss_weight (None when no sample carries them; NaN may
    # stand where the loss mask is 0), and each position's sequence's loss-token count.
    advantages: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    rollout_logprobs: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    sequence_targets: torch.Tensor | None = None
    # Packed layout only (None when padded): per-token sequence index [1, s_local], and the
    # cumulative real and per-sequence padded lengths of the whole row [n + 1] (int32).
    segment_ids: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    cu_seqlens_padded: torch.Tensor | None = None

    @property
    def is_packed(self) -> bool:
        return self.segment_ids is not None

    @property
    def is_empty(self) -> bool:
        return self.tokens.shape[0] == 0

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    def to(self, device) -> MicrobatchTensors:
        moved = {
            k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v) for k, v in vars(self).items()
        }
        return MicrobatchTensors(**moved)


def cp_shard(x: torch.Tensor, cp_rank: int, cp_size: int, dim: int = 1) -> torch.Tensor:
    """Keep chunks cp_rank and 2*cp_size-1-cp_rank of 2*cp_size along ``dim``."""
    if cp_size == 1:
        return x
    length = x.shape[dim]
    if length % (2 * cp_size):
        raise ValueError(f"a CP row of {length} tokens is not a multiple of 2*cp_size={2 * cp_size}")
    if not length:  # an empty microbatch stays empty
        return x
    chunks = x.chunk(2 * cp_size, dim=dim)
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim=dim)


def cp_unshard(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of cp_shard over all CP ranks' parts (for tests and gathering outputs)."""
    cp_size = len(parts)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp_size)
    for rank, part in enumerate(parts):
        first, second = part.chunk(2, dim=dim)
        chunks[rank], chunks[2 * cp_size - 1 - rank] = first, second
    return torch.cat(chunks, dim=dim)  # type: ignore[arg-type]


def collate(
    samples: list[Sample], sample_ids: list[int], mb: Microbatch, *, cp_rank: int = 0, cp_size: int = 1
) -> MicrobatchTensors:
    """Right-pad ``samples`` to ``mb.padded_len`` and cut this CP rank's chunks (or, for a packed
    microbatch, lay them out back to back in one row: ``collate_packed``)."""
    if mb.packed:
        return collate_packed(samples, sample_ids, mb, cp_rank=cp_rank, cp_size=cp_size)
    rows, length = len(samples), mb.padded_len
    tokens = np.zeros((rows, length), dtype=np.int64)
    labels = np.zeros((rows, length), dtype=np.int64)
    loss_mask = np.zeros((rows, length), dtype=np.float32)
    loss_weight = np.zeros((rows, length), dtype=np.float32)
    valid = np.zeros((rows, length), dtype=bool)
    seq_lengths = np.zeros(rows, dtype=np.int64)
    extra = _extra_arrays(samples, (rows, length))
    for r, s in enumerate(samples):
        n = len(s.tokens)
        if n > length:
            raise ValueError(f"sample {sample_ids[r]} has {n} tokens, over the microbatch's padded length {length}")
        seq_lengths[r] = n
        tokens[r, :n] = s.tokens
        labels[r, : n - 1] = s.tokens[1:]
        target = np.ones(n - 1, dtype=np.float32) if s.loss_mask is None else s.loss_mask[1:].astype(np.float32)
        loss_mask[r, : n - 1] = target
        weight = np.ones(n - 1, dtype=np.float32) if s.loss_weight is None else s.loss_weight[1:]
        loss_weight[r, : n - 1] = target * weight
        valid[r, :n] = True
        _fill_extra(extra, s, (r, slice(0, n - 1)))
    position_ids = np.tile(np.arange(length, dtype=np.int64), (rows, 1))

    def cut(a: np.ndarray) -> torch.Tensor:
        return cp_shard(torch.from_numpy(np.ascontiguousarray(a)), cp_rank, cp_size)

    return MicrobatchTensors(
        tokens=cut(tokens),
        labels=cut(labels),
        loss_mask=cut(loss_mask),
        loss_weight=cut(loss_weight),
        position_ids=cut(position_ids),
        valid=cut(valid),
        seq_lengths=torch.from_numpy(seq_lengths),
        sample_ids=torch.tensor(sample_ids, dtype=torch.int64),
        padded_len=length,
        **{name: cut(a) for name, a in extra.items()},
    )


def _extra_arrays(samples: list[Sample], shape) -> dict[str, np.ndarray]:
    """Zeroed float32 arrays for ``sequence_targets`` and each policy field some sample carries;
    ``rollout_logprobs`` (optional per row: the mismatch measures) is NaN where a sample has none."""
    names = ["sequence_targets", *(f for f in POLICY_FIELDS if any(getattr(s, f) is not None for s in samples))]
    return {name: np.full(shape, np.nan if name == "rollout_logprobs" else 0.0, dtype=np.float32) for name in names}


def _fill_extra(extra: dict[str, np.ndarray], s: Sample, where) -> None:
    """Write sample ``s``'s target-aligned values (entries 1..n-1) into ``extra[...][where]``."""
    for name, arr in extra.items():
        if name == "sequence_targets":
            arr[where] = s.loss_tokens()
        elif getattr(s, name) is not None:
            arr[where] = getattr(s, name)[1:]


def packed_cp_index(segments: list[int], cp_rank: int, cp_size: int) -> np.ndarray:
    """Row offsets this CP rank holds of a packed row, in local order (every sequence's chunks
    cp_rank and 2cp-1-cp_rank)."""
    ranges = cp_ranges(segments, cp_size, cp_rank)
    return np.concatenate([np.arange(s, e) for s, e in ranges]) if ranges else np.zeros(0, dtype=np.int64)


def packed_cp_unshard(parts: list[torch.Tensor], segments: list[int], dim: int = 1) -> torch.Tensor:
    """Inverse of the packed CP cut over all CP ranks' parts (gathering outputs, tests)."""
    cp_size = len(parts)
    index = np.concatenate([packed_cp_index(segments, r, cp_size) for r in range(cp_size)])
    inverse = torch.from_numpy(np.argsort(index, kind="stable"))
    return torch.cat(parts, dim=dim).index_select(dim, inverse.to(parts[0].device))


def collate_packed(
    samples: list[Sample], sample_ids: list[int], mb: Microbatch, *, cp_rank: int = 0, cp_size: int = 1
) -> MicrobatchTensors:
    """One row of ``samples`` back to back (``mb.padded_len`` long), then this CP rank's chunks."""
    lengths = [len(s.tokens) for s in samples]
    segments = segment_lengths(lengths, cp_size, mb.padded_len)
    length = mb.padded_len
    tokens = np.zeros(length, dtype=np.int64)
    labels = np.zeros(length, dtype=np.int64)
    loss_mask = np.zeros(length, dtype=np.float32)
    loss_weight = np.zeros(length, dtype=np.float32)
    valid = np.zeros(length, dtype=bool)
    positions = np.zeros(length, dtype=np.int64)
    seq_ids = np.zeros(length, dtype=np.int64)
    extra = _extra_arrays(samples, (length,))
    offset = 0
    for i, (s, n, seg) in enumerate(zip(samples, lengths, segments)):
        tokens[offset : offset + n] = s.tokens
        labels[offset : offset + n - 1] = s.tokens[1:]  # the last token predicts nothing
        target = np.ones(n - 1, dtype=np.float32) if s.loss_mask is None else s.loss_mask[1:].astype(np.float32)
        loss_mask[offset : offset + n - 1] = target
        weight = np.ones(n - 1, dtype=np.float32) if s.loss_weight is None else s.loss_weight[1:]
        loss_weight[offset : offset + n - 1] = target * weight
        valid[offset : offset + n] = True
        _fill_extra(extra, s, slice(offset, offset + n - 1))
        positions[offset : offset + seg] = np.arange(seg)
        seq_ids[offset : offset + seg] = i
        offset += seg
    index = packed_cp_index(segments, cp_rank, cp_size) if cp_size > 1 else slice(None)

    def cut(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a[index])).unsqueeze(0)

    return MicrobatchTensors(
        tokens=cut(tokens),
        labels=cut(labels),
        loss_mask=cut(loss_mask),
        loss_weight=cut(loss_weight),
        position_ids=cut(positions),
        valid=cut(valid),
        seq_lengths=torch.tensor(lengths, dtype=torch.int64),
        sample_ids=torch.tensor(sample_ids, dtype=torch.int64),
        padded_len=length,
        segment_ids=cut(seq_ids),
        cu_seqlens=torch.tensor(np.cumsum([0, *lengths]), dtype=torch.int32),
        cu_seqlens_padded=torch.tensor(np.cumsum([0, *segments]), dtype=torch.int32),
        **{name: cut(a) for name, a in extra.items()},
    )
