"""``python tools/simulate_batching.py ...``: the user command in ``backend.commands.simulate_batching`` (installed as ``backend-simulate-batching``)."""

from backend.commands.simulate_batching import main

if __name__ == "__main__":
    raise SystemExit(main())
