"""Training: the trainer, one train step, forward-only log-probabilities, checkpoints.

The command-line entry point is ``backend.train.cli.main``: ``python -m backend.train`` or the
installed ``backend-train`` script.
"""
