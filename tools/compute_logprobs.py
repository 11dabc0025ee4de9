"""``python tools/compute_logprobs.py ...``: the user command in ``backend.commands.compute_logprobs`` (installed as ``backend-compute-logprobs``)."""

from backend.commands.compute_logprobs import main

if __name__ == "__main__":
    raise SystemExit(main())
