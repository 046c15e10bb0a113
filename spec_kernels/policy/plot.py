"""The output-tok/s-vs-concurrency figure shared by the policy's plot and serve_check's."""
from __future__ import annotations

from .._extras import import_extra


def throughput_figure(purpose: str):
    """(pyplot, figure, axes) for a file-only plot; matplotlib is the ``bench`` extra."""
    matplotlib = import_extra("matplotlib", "bench", purpose)
    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    return plt, fig, ax


def save_throughput_figure(plt, fig, ax, path: str, xlabel: str, title: str) -> None:
    """Log concurrency axis, labels, grid and legend; written to `path` and closed."""
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("output tok/s")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
