"""``python tools/show_data.py ...``: the user command in ``backend.commands.show_data`` (installed as ``backend-show-data``)."""

from backend.commands.show_data import main

if __name__ == "__main__":
    raise SystemExit(main())
