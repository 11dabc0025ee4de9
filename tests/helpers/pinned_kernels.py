"""Run ``python -m MODULE ARGS...`` with the paths from before the RL step's fast paths pinned.

``python pinned_kernels.py MODULE [ARGS...]`` (also as torchrun's script), pinning what the
environment's ``PINNED`` names (comma-separated; default both):

- ``kernels``: the dense-mask and per-sequence SDPA calls
  (``backend.model.attention.sdpa.CAUSAL_FAST_PATHS``) and n prefills a prompt
  (``HFGenerator.share_prompt_prefill``): the same numbers to FP32 rounding;
- ``sampler``: torch.multinomial's draws (``HFGenerator.sampler``): the same tokens for a seed.

So a tree's numbers can be compared bit for bit with a commit from before those paths; a tree
without the switches runs as it is.
"""

from __future__ import annotations

import os
import runpy
import sys


def pin(what: str | None = None) -> None:
    import backend.model.attention.sdpa as sdpa
    from backend.generators.hf import HFGenerator

    what = set((what or os.environ.get("PINNED") or "kernels,sampler").split(","))
    if "kernels" in what and hasattr(sdpa, "CAUSAL_FAST_PATHS"):
        sdpa.CAUSAL_FAST_PATHS = False
    if "kernels" in what and hasattr(HFGenerator, "share_prompt_prefill"):
        HFGenerator.share_prompt_prefill = False
    if "sampler" in what and hasattr(HFGenerator, "sampler"):
        HFGenerator.sampler = "multinomial"


if __name__ == "__main__":
    pin()
    module = sys.argv[1]
    sys.argv = [module, *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
