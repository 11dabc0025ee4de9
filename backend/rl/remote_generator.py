"""Kept importable: this module moved to ``backend.generators.process`` (the generators' own package).
The name below is that module itself, so every attribute (and pickled reference) is the same."""

import sys

from backend.generators import process

sys.modules[__name__] = process
