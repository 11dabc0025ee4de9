"""``python tools/export_hf.py ...``: the user command in ``backend.commands.export_hf`` (installed as ``backend-export-hf``)."""

from backend.commands.export_hf import main

if __name__ == "__main__":
    raise SystemExit(main())
