"""Matplotlib without a display, and one way to write a figure (run curves, sweep plots)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["pyplot", "save_figure"]


def pyplot() -> Any:
    """`matplotlib.pyplot` on the non-interactive Agg backend (no display on servers and CI);
    imported on use, since matplotlib is only in the `dev` extra."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, out: str | Path) -> Path:
    """Write `fig` as a PNG (creating the folder) and free it."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    pyplot().close(fig)
    return out
