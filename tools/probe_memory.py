"""``python tools/probe_memory.py ...``: the user command in ``backend.commands.probe_memory`` (installed as ``backend-probe-memory``)."""

from backend.commands.probe_memory import main

if __name__ == "__main__":
    raise SystemExit(main())
