"""Training: the trainer, one train step, forward-only log-probabilities, checkpoints.

The command-line entry point is ``python -m backend.train`` (``backend/train/__main__.py``).
"""
