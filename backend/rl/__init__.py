"""RL on top of the engine: ``PolicyWorker`` / ``ValueWorker`` (the engine driven from memory), an in-process
generator fed by the Hugging Face weight stream (``generate``), and the GRPO loop
(``python -m backend.rl CONFIG``). Nothing below ``backend.rl`` imports it."""

from .worker import PolicyWorker, ValueWorker

__all__ = ["PolicyWorker", "ValueWorker"]
