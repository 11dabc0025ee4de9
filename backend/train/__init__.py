"""Training: the engine and its data-stream driver (the trainer), the one run loop, one train step,
forward-only passes, the memory probe.

The command-line entry point is ``backend.train.cli.main``: ``python -m backend.train`` or the
installed ``backend-train`` script.
"""
