"""``python tools/plot_metrics.py ...``: the user command in ``backend.commands.plot_metrics`` (installed as ``backend-plot-metrics``)."""

from backend.commands.plot_metrics import main

if __name__ == "__main__":
    raise SystemExit(main())
