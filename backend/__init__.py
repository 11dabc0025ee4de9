"""A Megatron-style, config-driven LLM training backend with dynamic batching."""

__version__ = "0.1.0"
