"""The user commands: each module's ``main(argv)`` is a console script (``backend-compute-logprobs``,
``backend-export-hf``, ...; ``pyproject.toml``) and ``python tools/<name>.py`` runs the same."""
