"""``python tools/generate.py ...``: the user command in ``backend.commands.generate`` (installed as ``backend-generate``)."""

from backend.commands.generate import main

if __name__ == "__main__":
    raise SystemExit(main())
