"""matplotlib for the PNG plots (eval reports, training curves): imported lazily (extra `plots`), with the Agg
backend (no display needed). `save_png` writes a figure whole or not at all."""
from __future__ import annotations

import io
from pathlib import Path

from dspark.io import atomic_write_bytes


def pyplot():
    """matplotlib.pyplot on the Agg backend; ImportError saying how to install it."""
    try:
        import matplotlib
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("PNG plots need matplotlib: pip install 'dspark[plots]' (or set plots=false)") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig, path: Path, dpi: int = 120) -> Path:
    """The figure as a PNG at `path`, rendered in memory and written atomically (dspark.io): a process killed while
    saving leaves the previous file or none, never a 0-byte or half-written PNG."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    atomic_write_bytes(Path(path), buf.getvalue())
    return Path(path)
