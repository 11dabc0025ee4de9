"""``python tools/preprocess_data.py ...``: the user command in ``backend.commands.preprocess_data`` (installed as ``backend-preprocess-data``)."""

from backend.commands.preprocess_data import main

if __name__ == "__main__":
    raise SystemExit(main())
