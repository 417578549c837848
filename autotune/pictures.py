"""What every picture autotune draws shares (the report's, autotune/report/pictures.py, and the plan's,
autotune/plan/picture.py): matplotlib on its Agg backend, figures saved as PNG files."""

from __future__ import annotations

from pathlib import Path


def pyplot():
    """matplotlib.pyplot on the Agg backend: files only, no display or server needed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: Path) -> Path:
    """Lay out, write `path` at 100 dpi, close the figure (pyplot keeps every open one otherwise)."""
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    pyplot().close(fig)
    return path
