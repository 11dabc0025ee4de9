"""Writing a matplotlib figure as a PNG for the plotting tools (no display needed: Agg backend)."""

from __future__ import annotations

from pathlib import Path


def save_png(fig, out: str | Path, dpi: int) -> Path:
    """Save ``fig`` to ``out`` (folders made as needed) and free it; returns the path."""
    import matplotlib.pyplot as plt

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out
