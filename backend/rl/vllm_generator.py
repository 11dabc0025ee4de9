"""Kept importable: this module moved to ``backend.generators.vllm_local`` (the generators' own package).
The name below is that module itself, so every attribute (and pickled reference) is the same."""

import sys

from backend.generators import vllm_local

sys.modules[__name__] = vllm_local
