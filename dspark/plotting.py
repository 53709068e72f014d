"""matplotlib for the PNG plots (eval reports, training curves): imported lazily (extra `plots`), with the Agg
backend (no display needed)."""
from __future__ import annotations


def pyplot():
    """matplotlib.pyplot on the Agg backend; ImportError saying how to install it."""
    try:
        import matplotlib
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("PNG plots need matplotlib: pip install 'dspark[plots]' (or set plots=false)") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
