"""Weighted data blends (``data.blend``): several data sets, each drawn from by its weight.

As Megatron's ``--data-path 0.3 A 0.7 B`` (its ``BlendedDataset``): the stream's n-th sample
comes from the source whose share is furthest behind its weight (the source k maximising
w_k x (n + 1) - drawn_k, ties to the lower index), so after n samples every source has drawn
within one sample of w_k x n: no sampling noise in the mix, and a resume needs only the count of
samples drawn. Within a source, draws walk a seeded permutation per pass ([seed, k, pass]), as
``WindowSampler`` walks the whole data set, so every sample of a source is seen once per pass.

The blended data set is the sources one after another (ids offset by the sizes before them); the
planner, collation and checkpoints see one data set. Weights are normalised (0.3 / 0.7 and 3 / 7
blend alike).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .errors import DataStreamError


def build_blend(data_cfg, *, build):
    """(BlendedDataset, tokenizer) of ``data_cfg.blend``'s sources, each built by ``build`` (the
    caller's ``build_dataset`` with its row fields) as if it were data.path; any other config (the
    validation set's data.valid_path) is ``build``'s alone."""
    if not data_cfg.blend or data_cfg.path != "embedded":
        return build(data_cfg)
    parts, tokenizer = [], None
    for src in data_cfg.blend:
        dataset, tok = build(dataclasses.replace(data_cfg, path=src.path, blend=[]))
        parts.append((src.path, dataset))
        tokenizer = tokenizer or tok
    return BlendedDataset(parts, [src.weight for src in data_cfg.blend]), tokenizer


class BlendedDataset:
    """The sources' samples back to back: id ``offsets[k] + i`` is source k's sample i."""

    def __init__(self, parts: list[tuple[str, object]], weights: list[float]):
        self.names = [name for name, _ in parts]
        self.parts = [ds for _, ds in parts]
        self.weights = normalised(weights)
        sizes = [len(ds) for ds in self.parts]
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.lengths = np.concatenate([np.asarray(ds.lengths, dtype=np.int64) for ds in self.parts])
        self.loss_token_counts = np.concatenate([np.asarray(ds.loss_token_counts, np.int64) for ds in self.parts])
        self.has_loss_weight = any(getattr(ds, "has_loss_weight", False) for ds in self.parts)
        self.ignored_fields = {}
        for ds in self.parts:
            for key, count in (getattr(ds, "ignored_fields", None) or {}).items():
                self.ignored_fields[key] = self.ignored_fields.get(key, 0) + count
        self.source = "blend of " + ", ".join(
            f"{name} ({w:.3g}, {n:,} samples)" for name, w, n in zip(self.names, self.weights, sizes)
        )
        self.note = "; ".join(
            f"{name}: {ds.note}" for name, ds in zip(self.names, self.parts) if getattr(ds, "note", "")
        )
        self.report = _combined_report([ds.report for ds in self.parts])

    @property
    def sizes(self) -> list[int]:
        return [len(ds) for ds in self.parts]

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, index: int):
        k = int(np.searchsorted(self.offsets, index, side="right")) - 1
        return self.parts[k][int(index - self.offsets[k])]

    def source_counts(self, ids) -> dict[str, int]:
        """How many of ``ids`` (a window) each source gave, by source name (the step row's
        ``blend_samples``)."""
        k = np.searchsorted(self.offsets, np.asarray(ids), side="right") - 1
        counts = np.bincount(k, minlength=len(self.parts))
        return {name: int(c) for name, c in zip(self.names, counts)}


def _combined_report(reports):
    """The sources' over-length reports added up (one object for the summary and the step rows)."""
    first = reports[0]
    if first is None:
        return None
    out = type(first)(first.max_seq_length, first.policy)
    for r in reports:
        for key in ("truncated", "dropped", "truncated_tokens"):
            setattr(out, key, getattr(out, key) + getattr(r, key))
    return out


def normalised(weights: list[float]) -> list[float]:
    total = float(sum(weights))
    return [float(w) / total for w in weights]


def blend_sources(weights: list[float], start: int, count: int, drawn: np.ndarray | None = None):
    """(source index, the source's draw number) for stream positions ``start .. start + count - 1``
    under the greedy rule of the module docstring. ``drawn``: the draws per source before
    ``start`` (replayed from 0 when not given)."""
    w = np.asarray(normalised(weights))
    if drawn is None:
        drawn = np.zeros(len(w), dtype=np.int64)
        if start:
            blend_sources(weights, 0, start, drawn)
    out = np.empty((count, 2), dtype=np.int64)
    for i, n in enumerate(range(start, start + count)):
        k = int(np.argmax(w * (n + 1) - drawn))
        out[i] = (k, drawn[k])
        drawn[k] += 1
    return out


class BlendSampler:
    """``WindowSampler``'s interface (``next_window``, ``state_dict``, ``load_state_dict``) over a
    ``BlendedDataset``: windows of ``global_batch_size`` ids in blend order (module docstring)."""

    def __init__(self, sizes: list[int], weights: list[float], global_batch_size: int, seed: int):
        self.sizes = [int(n) for n in sizes]
        self.weights = normalised(weights)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.consumed = 0
        self._drawn = np.zeros(len(self.sizes), dtype=np.int64)  # draws per source before ``consumed``
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    @property
    def num_samples(self) -> int:
        return int(self.offsets[-1])

    def _permutation(self, k: int, epoch: int) -> np.ndarray:
        key = (k, epoch)
        if key not in self._perms:
            if len(self._perms) > 4 * len(self.sizes):
                self._perms.clear()
            self._perms[key] = np.random.default_rng([self.seed, k, epoch]).permutation(self.sizes[k])
        return self._perms[key]

    def next_window(self) -> np.ndarray:
        picks = blend_sources(self.weights, self.consumed, self.global_batch_size, self._drawn)
        self.consumed += self.global_batch_size
        ids = []
        for k, draw in picks:
            epoch, offset = divmod(int(draw), self.sizes[k])
            ids.append(self.offsets[k] + self._permutation(int(k), epoch)[offset])
        return np.asarray(ids, dtype=np.int64)

    def state_dict(self) -> dict:
        """``WindowSampler``'s keys (the checkpoint's schema) and the blend's sources."""
        return {
            "consumed": self.consumed,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "global_batch_size": self.global_batch_size,
            "shuffle": True,
            "blend": {"sizes": list(self.sizes), "weights": list(self.weights)},
        }

    def load_state_dict(self, state: dict) -> None:
        blend = state.get("blend") or {}
        theirs = {"seed": state.get("seed"), "global_batch_size": state.get("global_batch_size"), **blend}
        for key, ours in (
            ("seed", self.seed),
            ("global_batch_size", self.global_batch_size),
            ("sizes", self.sizes),
            ("weights", self.weights),
        ):
            value = theirs.get(key)
            if key == "weights" and value is not None:
                same = len(value) == len(ours) and np.allclose(value, ours, rtol=0, atol=1e-12)
            else:
                same = value == ours
            if not same:
                raise DataStreamError(
                    f"cannot resume the blended data stream: the checkpoint's {key}={value} differs from this "
                    f"run's {ours}; the same samples would not follow (restore data.blend, train.seed and "
                    "train.global_batch_size)"
                )
        self.consumed = int(state["consumed"])
        self._drawn = np.zeros(len(self.sizes), dtype=np.int64)
        if self.consumed:
            blend_sources(self.weights, 0, self.consumed, self._drawn)
