"""The one interface every rollout generator keeps, so the RL loops never ask which engine runs.

- ``Generator`` (every engine: transformers and vLLM in process, the generator process, vLLM
  servers): ``load_weights(stream, version)`` takes the trainer's Hugging Face weight stream (each
  ``(name, full tensor)`` once, in the whole model's order) and returns ``SyncStats``; ``close()``
  releases what the engine holds (process groups, child processes, servers).
- ``Sampler`` (the synchronous loop, ``rl.max_staleness: 0``): ``generate_batch`` of prompts with one
  seed per prompt, ``n`` completions each.
- ``Probed``: ``probe_logprobs(token_ids)`` gives the engine's log-probabilities of ``token_ids[1:]``
  (one list, or one per engine keyed by URL) for the check after every sync; the transformers
  generator in the trainer's own process runs the trainer's imported weights and has none.
- ``Queued`` (the asynchronous loop, ``>= 1``): ``submit`` a step's prompts, ``has_reply`` /
  ``receive`` its ``Rollout``, the ``pending`` property counts what is in flight.

These are ``typing.Protocol`` classes: an engine satisfies them by its methods, and
``isinstance(engine, Probed)`` is how a loop asks for an optional one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

from .results import Completion, Rollout, SyncStats


@runtime_checkable
class Generator(Protocol):
    def load_weights(self, weights: Iterable[tuple[str, object]], version: int | None = None) -> SyncStats: ...

    def close(self) -> None: ...


@runtime_checkable
class Sampler(Generator, Protocol):
    def generate_batch(
        self, prompts: Sequence[Sequence[int]], n: int, temperature: float, max_new_tokens: int, seeds: Sequence[int]
    ) -> list[list[Completion]]: ...


@runtime_checkable
class Probed(Protocol):
    def probe_logprobs(self, token_ids: Sequence[int]) -> list[float] | dict[str, list[float]]: ...


@runtime_checkable
class Queued(Generator, Protocol):
    def submit(self, step: int, prompts, n: int, temperature: float, max_new_tokens: int, seeds) -> None: ...

    def has_reply(self, timeout: float = 0.0) -> bool: ...

    def receive(self) -> Rollout: ...

    @property
    def pending(self) -> int: ...
