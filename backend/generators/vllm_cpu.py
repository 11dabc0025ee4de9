"""vLLM's scheduling on CPU: no prompt prefilled in chunks.

A step whose prompts together exceed ``max_num_batched_tokens`` (4,096 by default: 64 prompts of
66 tokens) has its last request prefilled in chunks, and vLLM then rewinds that request's seeded
generator (``gen.set_offset``), which only CUDA generators have ("CPU Generator does not use
offset": the step died). On CPU an engine (in process or a server) schedules at most
``max_num_seqs`` requests a step with a token budget of ``max_num_seqs x max_model_len``, so every
scheduled prompt fits whole (no chunk, no rewind, the same draws for a seed); the budget is kept
under ``CPU_TOKEN_BUDGET`` tokens by scheduling fewer requests a step when ``max_model_len`` is
long. CUDA keeps vLLM's defaults.
"""

from __future__ import annotations

#: The most tokens one CPU engine step may schedule (``max_num_batched_tokens``): 64 requests of
#: 1,024 tokens. The engine sizes per-token buffers by it (a few bytes to a hidden state a token).
CPU_TOKEN_BUDGET = 65_536


def cpu_scheduling(max_model_len: int, max_num_seqs: int = 64) -> dict:
    """vLLM engine arguments under which no prompt is prefilled in chunks (module docstring):
    ``max_num_seqs`` lowered until ``max_num_seqs x max_model_len`` fits ``CPU_TOKEN_BUDGET`` (at
    least one request), and that product as the token budget."""
    seqs = max(1, min(max_num_seqs, CPU_TOKEN_BUDGET // max(1, max_model_len)))
    return {"max_model_len": max_model_len, "max_num_seqs": seqs, "max_num_batched_tokens": seqs * max_model_len}
