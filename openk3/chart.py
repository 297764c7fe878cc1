"""The two steps every chart of openk3 shares (training loss, the planner's memory chart): a matplotlib
figure that needs no display, and an atomic PNG write. Imports no torch (the planner must not)."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

from openk3.fsutil import write_atomic

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def new_figure(width_in: float, height_in: float, dpi: int) -> Figure:
    """A bare Figure on the Agg canvas, not pyplot: no display is needed (CI, servers), the caller's
    matplotlib backend is left alone, and nothing is kept in pyplot's figure registry, so there is no figure
    to close and repeated saves (a loss plot at every checkpoint) do not accumulate."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width_in, height_in), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save_png(fig: Figure, path: str) -> None:
    """Render `fig` to PNG in memory, then write it atomically (a failed render leaves `path` as it was)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    write_atomic(path, buf.getvalue())
