"""One small helper so every benchmark draws its PNG the same way, headless (Agg backend).

``matplotlib.figure.Figure`` with an explicit Agg canvas never touches pyplot's global state,
so plotting works without a display and from any thread.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

Panel = Callable[[Any], None]
"""Draws one panel on the ``matplotlib.axes.Axes`` it is given."""


def save_plot(
    path: Path, panels: Sequence[Panel], title: str | None = None, panel_size=(5.0, 3.6)
) -> Path:
    """Draw ``panels`` side by side and write them as a PNG.

    Args:
        path: Destination file (parent directories are created).
        panels: One callable per panel, each drawing on its own Axes.
        title: Figure title (e.g. model and date), if any.
        panel_size: Width and height of one panel in inches.

    Returns:
        ``path``.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # heavy; import when plotting
    from matplotlib.figure import Figure

    figure = Figure(figsize=(panel_size[0] * len(panels), panel_size[1]), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, len(panels), squeeze=False)[0]
    for draw, ax in zip(panels, axes, strict=True):
        draw(ax)
        ax.grid(True, alpha=0.3)
    if title:
        figure.suptitle(title, fontsize=10)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    return path


def write_report(
    report: dict, out: Path, plot: Callable[[dict, Path], Path], plot_path: Path | None = None
) -> None:
    """Write a benchmark's JSON to ``out`` and its PNG next to it (or to ``plot_path``)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    png = plot(report, plot_path or out.with_suffix(".png"))
    print(f"wrote {out} and {png}")


def bar_labels(ax: Any, bars: Any, fmt: str) -> None:
    """Write each bar's value above it."""
    ax.bar_label(bars, labels=[fmt.format(b.get_height()) for b in bars], fontsize=8)
