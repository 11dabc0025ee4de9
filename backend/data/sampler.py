"""Optimizer windows: ``global_batch_size`` sample ids per step from a seeded, endless stream.

The stream is epoch after epoch of a permutation seeded by (seed, epoch), so it is the same on
every rank and in every process; windows are consecutive slices of it, so no sample is dropped
(a window may straddle two epochs). The state is one counter and restores the stream exactly.
"""

from __future__ import annotations

import numpy as np

from .errors import DataFileError, DataStreamError

# What a changed sampler setting means for the user, as the config key to restore.
_STATE_KEYS = {
    "seed": "train.seed",
    "num_samples": "data.path / data.max_seq_length / data.overlong (the data set's size)",
    "global_batch_size": "train.global_batch_size",
    "shuffle": "the sampler's shuffle setting",
}


def oversampling_factor(num_samples: int, global_batch_size: int) -> float:
    """How many times each sample appears per optimizer window: global_batch_size / num_samples
    when a window is larger than the data set (the same sample then sits in one window two or
    more times, which the trainer should warn about), else 1.0."""
    if num_samples < 1:
        raise DataFileError("the data set is empty: nothing to sample (data.path)")
    return max(1.0, global_batch_size / num_samples)


class WindowSampler:
    def __init__(self, num_samples: int, global_batch_size: int, seed: int, *, shuffle: bool = True):
        if num_samples < 1:
            raise DataFileError("the data set is empty: nothing to sample (data.path)")
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.consumed = 0  # samples handed out so far
        self._epoch_cache: tuple[int, np.ndarray] | None = None

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            if self.shuffle:
                perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            else:
                perm = np.arange(self.num_samples)
            self._epoch_cache = (epoch, perm)
        return self._epoch_cache[1]

    @property
    def epoch(self) -> int:
        return self.consumed // self.num_samples

    def next_window(self) -> np.ndarray:
        """The next window's dataset indices, in stream order."""
        out = []
        need = self.global_batch_size
        while need:
            epoch, offset = divmod(self.consumed, self.num_samples)
            take = min(need, self.num_samples - offset)
            out.append(self._permutation(epoch)[offset : offset + take])
            self.consumed += take
            need -= take
        return np.concatenate(out)

    def state_dict(self) -> dict:
        return {
            "consumed": self.consumed,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "global_batch_size": self.global_batch_size,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "num_samples", "global_batch_size", "shuffle"):
            if state[key] != getattr(self, key):
                raise DataStreamError(
                    f"cannot resume the data stream: the checkpoint's {key}={state[key]} differs from this run's "
                    f"{getattr(self, key)}; the same samples would not follow (restore {_STATE_KEYS[key]})"
                )
        self.consumed = int(state["consumed"])
