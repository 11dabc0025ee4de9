"""``python tools/verify_checkpoint.py DIR``: the user command in ``backend.commands.verify_checkpoint`` (installed as ``backend-verify-checkpoint``)."""

from backend.commands.verify_checkpoint import main

if __name__ == "__main__":
    raise SystemExit(main())
