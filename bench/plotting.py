"""matplotlib for the benchmarks' plots: an optional dependency, drawn off-screen."""
from __future__ import annotations


def pyplot(path: str):
    """matplotlib.pyplot with the Agg backend, or None (and a line saying so) when
    matplotlib is not installed: the benchmark then writes no plot to `path`."""
    try:
        import matplotlib
    except ImportError:
        print(f"\nmatplotlib is not installed (pip install matplotlib); no plot written to {path}")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
