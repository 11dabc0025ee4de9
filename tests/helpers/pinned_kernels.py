"""Run ``python -m MODULE ARGS...`` with the kernels from before the causal fast paths pinned.

``python pinned_kernels.py MODULE [ARGS...]`` (also as torchrun's script): the dense-mask and
per-sequence SDPA calls (``backend.model.attention.sdpa.CAUSAL_FAST_PATHS``) and n prefills a
prompt (``HFGenerator.share_prompt_prefill``), so a tree's numbers can be compared bit for bit
with a commit from before those paths; a tree without the switches runs as it is.
"""

from __future__ import annotations

import runpy
import sys


def pin() -> None:
    import backend.model.attention.sdpa as sdpa
    from backend.rl.generate import HFGenerator

    if hasattr(sdpa, "CAUSAL_FAST_PATHS"):
        sdpa.CAUSAL_FAST_PATHS = False
    if hasattr(HFGenerator, "share_prompt_prefill"):
        HFGenerator.share_prompt_prefill = False


if __name__ == "__main__":
    pin()
    module = sys.argv[1]
    sys.argv = [module, *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
