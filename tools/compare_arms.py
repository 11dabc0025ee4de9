"""``python tools/compare_arms.py ...``: the user command in ``backend.commands.compare_arms`` (installed as ``backend-compare-arms``)."""

from backend.commands.compare_arms import main

if __name__ == "__main__":
    raise SystemExit(main())
